"""The publisher's sampling settings apply to what a request leaves unset, can be overridden per request and turned
off per engine, and are shown; the server answers to the model alias `default`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest

from radixserve.model.sampling_defaults import PUBLISHER_DEFAULTS, load_sampling_defaults
from radixserve.server.app import build_app
from radixserve.server.background import BackgroundServer

PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def model_with_defaults(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("with-defaults") / "tiny"
    shutil.copytree(tiny_model_dir, out)
    config = (
        json.loads((out / "generation_config.json").read_text()) if (out / "generation_config.json").exists() else {}
    )
    (out / "generation_config.json").write_text(json.dumps({**config, "temperature": 0.0, "top_k": 7}))
    return out


def test_defaults_apply_to_unset_fields_and_yield_to_the_request(model_with_defaults: Path, make_engine) -> None:
    eng = make_engine(model_with_defaults)
    assert eng.model_info()["sampling_defaults"] == {"temperature": 0.0, "top_k": 7}
    unset = eng.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 12})
    greedy = eng.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 12, "temperature": 0})
    assert unset["output_ids"] == greedy["output_ids"]  # the model's temperature 0 applied
    sampled = [
        eng.generate(
            input_ids=PROMPT, sampling_params={"max_new_tokens": 12, "temperature": 5.0, "top_k": -1, "seed": s}
        )["output_ids"]
        for s in range(4)
    ]
    assert any(s != greedy["output_ids"] for s in sampled)  # the request's own values win


def test_defaults_off(model_with_defaults: Path, make_engine) -> None:
    eng = make_engine(model_with_defaults, sampling_defaults="none")
    assert eng.model_info()["sampling_defaults"] == {}
    with pytest.raises(ValueError, match="sampling_defaults"):
        make_engine(model_with_defaults, sampling_defaults="yes")


def test_known_gguf_gets_the_publisher_table(tmp_path: Path) -> None:
    folder = tmp_path / "qwen2.5-coder-0.5b-instruct"
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    assert load_sampling_defaults(folder) == PUBLISHER_DEFAULTS["qwen2.5-coder-0.5b-instruct"]
    (folder / "generation_config.json").write_text(json.dumps({"do_sample": False, "temperature": 0.6}))
    assert load_sampling_defaults(folder) == {"temperature": 0.0}  # the publisher asked for greedy


def test_server_shows_defaults_and_answers_to_default(model_with_defaults: Path, make_engine) -> None:
    eng = make_engine(model_with_defaults)
    with BackgroundServer(build_app(eng)) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        card = c.get("/v1/models").json()["data"][0]
        assert card["sampling_defaults"] == {"temperature": 0.0, "top_k": 7} and card["object"] == "model"
        assert c.get("/get_model_info").json()["sampling_defaults"] == {"temperature": 0.0, "top_k": 7}
        body = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        assert c.post("/v1/chat/completions", json=body).status_code == 200
        assert c.post("/v1/chat/completions", json={**body, "model": "gpt-4"}).status_code == 404
