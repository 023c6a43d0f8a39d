"""/generate as SGLang's clients speak it (issue 34): every field of SGLang's GenerateReqInput and SamplingParams is
either implemented or refused by name, streams are cumulative by default (deltas with
incremental_streaming_output), meta_info carries output_token_logprobs_length, and /server_info answers."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from radixserve import Engine
from radixserve.server.app import build_app
from radixserve.server.background import BackgroundServer
from server_fixtures import sse_events
from server_fixtures import engine, http, server  # noqa: F401  (fixtures)

PROMPT = "The capital of France is"
LONG = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}


def gen(http: httpx.Client, sp: dict[str, Any], **body: Any) -> dict[str, Any]:
    r = http.post("/generate", json={"text": PROMPT, "sampling_params": sp, **body})
    assert r.status_code == 200, r.text
    return r.json()


def stream(http: httpx.Client, sp: dict[str, Any], **body: Any) -> list[dict[str, Any]]:
    with http.stream("POST", "/generate", json={"text": PROMPT, "sampling_params": sp, "stream": True, **body}) as s:
        assert s.status_code == 200
        return sse_events(s.iter_lines())


def refusal(http: httpx.Client, body: dict[str, Any]) -> dict[str, Any]:
    r = http.post("/generate", json={"text": PROMPT, **body})
    assert r.status_code == 400, r.text
    return r.json()["error"]


@pytest.fixture(scope="module")
def incremental(engine: Engine) -> Iterator[httpx.Client]:  # noqa: F811
    with BackgroundServer(build_app(engine, incremental_streaming_output=True)) as srv:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            yield c


def test_sglang_client_request_is_accepted(http: httpx.Client) -> None:
    """The body SGLang's RuntimeEndpoint.generate sends for a plain gen, unset fields as it leaves them."""
    sp = {
        "skip_special_tokens": True,
        "spaces_between_special_tokens": True,
        "max_new_tokens": 4,
        "min_new_tokens": 0,
        "n": 1,
        "stop": [],
        "stop_token_ids": [],
        "stop_regex": [],
        "temperature": 0,
        "top_p": 1.0,
        "top_k": -1,
        "min_p": 0.0,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "ignore_eos": False,
        "regex": None,
        "json_schema": None,
    }
    out = gen(http, sp, image_data=None, log_metrics=True, session_id="s1", lora_path=None)
    assert out["meta_info"]["completion_tokens"] <= 4


def test_unknown_and_refused_fields_are_named(http: httpx.Client) -> None:
    assert refusal(http, {"bogus": 1})["param"] == "bogus"
    err = refusal(http, {"image_data": "http://x/y.png"})
    assert err["param"] == "image_data" and "text-only" in err["message"]
    assert refusal(http, {"session_params": {"id": "a"}})["param"] == "session_params"
    assert refusal(http, {"custom_logit_processor": "x"})["param"] == "custom_logit_processor"
    for field, value in (("structural_tag", "{}"), ("beam_width", 2), ("watermark", {"a": 1}), ("bogus_sp", 1)):
        assert refusal(http, {"sampling_params": {field: value}})["param"] == field
    assert refusal(http, {"sampling_params": {"max_new_tokens": 2, "min_new_tokens": 3}})["param"] == "min_new_tokens"
    assert refusal(http, {"sampling_params": {"stop_regex": "("}})["param"] == "stop_regex"
    assert refusal(http, {"sampling_params": {"logit_bias": {"x": 1.0}}})["param"] == "logit_bias"
    assert refusal(http, {"sampling_params": {"logit_bias": {"99999999": 1.0}}})["param"] == "logit_bias"
    assert refusal(http, {"sampling_params": {"seed": 1, "sampling_seed": 2}})["param"] == "sampling_seed"


def test_stream_is_cumulative_by_default(http: httpx.Client) -> None:
    whole = gen(http, LONG, return_logprob=True)
    events = stream(http, LONG, return_logprob=True)
    assert len(events) > 1
    for prev, ev in zip(events, events[1:]):
        assert ev["text"].startswith(prev["text"]) and ev["output_ids"][: len(prev["output_ids"])] == prev["output_ids"]
    for ev in events:
        meta = ev["meta_info"]
        assert len(ev["output_ids"]) == meta["completion_tokens"] == meta["output_token_logprobs_length"]
        assert len(meta["output_token_logprobs"]) == meta["completion_tokens"]
    last = events[-1]
    assert last["text"] == whole["text"] and last["output_ids"] == whole["output_ids"]
    assert whole["meta_info"]["output_token_logprobs_length"] == 16
    assert {"e2e_latency", "cached_tokens", "prompt_tokens"} <= set(whole["meta_info"])


def test_incremental_streaming_output_sends_deltas(incremental: httpx.Client, http: httpx.Client) -> None:
    whole = gen(http, LONG)
    events = stream(incremental, LONG, return_logprob=True)
    assert "".join(e["text"] for e in events) == whole["text"]
    assert [t for e in events for t in e["output_ids"]] == whole["output_ids"]
    done = 0
    for e in events:
        meta = e["meta_info"]
        assert len(meta["output_token_logprobs"]) == meta["output_token_logprobs_length"] - done
        done = meta["output_token_logprobs_length"]
    assert incremental.get("/server_info").json()["incremental_streaming_output"] is True


@pytest.mark.parametrize("path", ["/server_info", "/get_server_info"])
def test_server_info(http: httpx.Client, path: str) -> None:
    r = http.get(path)
    assert r.status_code == 200
    info = r.json()
    assert info["incremental_streaming_output"] is False and info["version"] and "model_path" in info


def test_min_new_tokens_holds_off_stop_tokens_and_strings(http: httpx.Client) -> None:
    ref = gen(http, LONG)
    stop_id = ref["output_ids"][1]
    sp = {"max_new_tokens": 16, "temperature": 0, "stop_token_ids": [stop_id]}
    assert gen(http, sp)["meta_info"]["completion_tokens"] == 2
    held = gen(http, {**sp, "min_new_tokens": 6})
    assert held["meta_info"]["completion_tokens"] >= 6 and stop_id not in held["output_ids"][:6]
    first = http.post("/detokenize", json={"tokens": ref["output_ids"][:1]}).json()["prompt"]
    sp = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True, "stop": [first]}
    assert gen(http, sp)["text"] == ""
    assert gen(http, {**sp, "min_new_tokens": 5})["meta_info"]["completion_tokens"] >= 5


def test_stop_regex_and_no_stop_trim(http: httpx.Client) -> None:
    text = gen(http, LONG)["text"]
    piece = text[len(text) // 2 : len(text) // 2 + 3]
    cut = text.find(piece)
    out = gen(http, {**LONG, "stop_regex": re.escape(piece)})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": re.escape(piece)}
    assert out["text"].startswith(text[: cut + len(piece)]) and text.startswith(out["text"])
    assert gen(http, {**LONG, "stop": [piece]})["text"] == text[:cut]
    assert gen(http, {**LONG, "stop": [piece], "no_stop_trim": True})["text"] == text[: cut + len(piece)]


def test_logit_bias_steers_sampling(http: httpx.Client) -> None:
    ref = gen(http, LONG)
    target = next(t for t in range(100, 200) if t not in ref["output_ids"])
    out = gen(http, {**LONG, "max_new_tokens": 6, "logit_bias": {str(target): 100.0}})
    assert out["output_ids"] == [target] * 6


def test_stream_interval_and_sampling_seed(http: httpx.Client) -> None:
    events = stream(http, {**LONG, "stream_interval": 4})
    counts = [0] + [e["meta_info"]["completion_tokens"] for e in events]
    # at least 4 new tokens per event (a verified draft may bring more at once), whatever is left in the last
    assert all(b - a >= 4 for a, b in zip(counts, counts[1:-1])) and counts[-1] == 16 and len(events) <= 4
    sampled = {"max_new_tokens": 8, "temperature": 1.0, "ignore_eos": True}
    assert gen(http, {**sampled, "sampling_seed": 7})["output_ids"] == gen(http, {**sampled, "seed": 7})["output_ids"]


def test_abort_request_by_rid_and_all(http: httpx.Client, server: BackgroundServer) -> None:  # noqa: F811
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}, "stream": True}
    with httpx.Client(base_url=server.url, timeout=60) as c:
        for rid, abort in (("job-1", {"rid": "job-1"}), ("job-2", {"abort_all": True})):
            with c.stream("POST", "/generate", json={**body, "rid": rid}) as s:
                assert s.status_code == 200
                lines = (line for line in s.iter_lines() if line.startswith("data: {"))
                next(lines)  # running now
                assert http.post("/abort_request", json={"rid": "someone-else"}).status_code == 200
                assert http.post("/abort_request", json=abort).status_code == 200
                last = json.loads(list(lines)[-1][len("data: ") :])
            assert last["meta_info"]["finish_reason"]["type"] == "abort"
            assert last["meta_info"]["completion_tokens"] < 400


def test_model_info_has_sglangs_keys(http: httpx.Client) -> None:
    info = http.get("/get_model_info").json()
    assert info["model_path"] == info["tokenizer_path"] and info["is_generation"] is True
    assert info["has_image_understanding"] is False


def test_token_ids_logprob(http: httpx.Client) -> None:
    wanted = [5, 17]
    out = gen(http, {**LONG, "max_new_tokens": 4}, return_logprob=True, top_logprobs_num=2, token_ids_logprob=wanted)
    meta = out["meta_info"]
    assert [[tid for _, tid in pos] for pos in meta["output_token_ids_logprobs"]] == [wanted] * 4
    assert all(len(pos) == 2 for pos in meta["output_top_logprobs"])
    for (chosen, tid), top in zip(meta["output_token_logprobs"], meta["output_top_logprobs"]):
        assert top[0][0] >= chosen  # greedy: the chosen token is the best one
    # the same positions scored as a prompt: its logprobs of the wanted ids match
    prompt = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    again = http.post(
        "/generate",
        json={
            "input_ids": prompt + out["output_ids"][:3],
            "sampling_params": {"max_new_tokens": 1, "temperature": 0},
            "return_logprob": True,
            "logprob_start_len": len(prompt),
            "token_ids_logprob": wanted,
        },
    ).json()["meta_info"]
    scored = again["input_token_ids_logprobs"] + again["output_token_ids_logprobs"]
    assert len(scored) == 4
    for got, ref in zip(scored, meta["output_token_ids_logprobs"]):
        assert [t for _, t in got] == wanted and all(abs(a[0] - b[0]) < 1e-3 for a, b in zip(got, ref))
    streamed = stream(http, {**LONG, "max_new_tokens": 4}, return_logprob=True, token_ids_logprob=wanted)
    assert streamed[-1]["meta_info"]["output_token_ids_logprobs"] == meta["output_token_ids_logprobs"]
    assert refusal(http, {"return_logprob": True, "token_ids_logprob": [10**9]})["param"] == "token_ids_logprob"


def test_readme_table_names_every_sglang_field() -> None:
    """frontend_dsl/README.md's tables of SGLang's native fields cover every field /generate and SamplingParams
    declare, so a field added to either without a row fails here."""
    from radixserve.sampling_params import SamplingParams
    from radixserve.server.protocol import GenerateBody

    readme = (Path(__file__).parents[1] / "frontend_dsl" / "README.md").read_text()
    section = readme.split("## SGLang's own client against radixserve")[1].split("\n## ")[0]
    named = set(re.findall(r"`(\w+)`", section))
    extras = {"timeout", "pin", "seed", "retention_seconds", "retention_priority"}  # radixserve's own, in its README
    missing = set(GenerateBody.__struct_fields__) | set(SamplingParams.__struct_fields__)
    assert not missing - named - extras
