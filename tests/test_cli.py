"""The `radixserve` command on the tiny model: bad model paths, serve's option plumbing, generate, and chat in a pty."""

from __future__ import annotations

import os
import re
import sys
import types
from collections.abc import Callable
from pathlib import Path

import pexpect
import pytest

from radixserve.cli import main

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("command", [["generate", "hi"], ["chat"], ["serve"]])
def test_bad_model_path_is_one_line_and_exit_2(command: list[str], tmp_path: Path, capsys) -> None:
    (tmp_path / "broken").mkdir()
    for model, message in ((tmp_path / "missing", "does not exist"), (tmp_path / "broken", "no config.json")):
        assert main([command[0], "--model", str(model), *command[1:]]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("radixserve: error: ") and message in err, err
        assert "Traceback" not in err


def test_serve_passes_options_to_run_server(tiny_model_dir: Path, monkeypatch) -> None:
    calls = []
    fake = types.ModuleType("radixserve.server.launch")
    fake.run_server = lambda *args, **kwargs: calls.append((args, kwargs))  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "radixserve.server.launch", fake)
    argv = [
        "serve",
        "--model",
        str(tiny_model_dir),
        "--host",
        "0.0.0.0",
        "--port",
        "31234",
        "--api-key",
        "sk-x",
        "--max-queued-requests",
        "7",
        "--page-size",
        "1",
        "--max-total-tokens",
        "4096",
        "--dtype",
        "float32",
        "--quantization",
        "int8",
        "--attention-backend",
        "torch",
        "--chunked-prefill-size",
        "64",
        "--schedule-policy",
        "fcfs",
        "--prefill-merge-tokens",
        "none",
        "--disable-radix-cache",
        "--context-length",
        "512",
        "--max-connections",
        "99",
        "--header-timeout",
        "3",
        "--body-timeout",
        "4",
        "--max-body-mb",
        "1",
        "--speculative",
        "ngram",
        "--speculative-max-tokens",
        "5",
        "--kv-cache-disk-gb",
        "0.5",
        "--kv-cache-host-gb",
        "0",
        "--kv-cache-dtype",
        "int8",
        "--max-pinned-share",
        "0.25",
        "--max-retained-share",
        "0.4",
        "--max-retained-share-per-tenant",
        "0.2",
        "--no-agent-retention",
        "--otlp-endpoint",
        "http://127.0.0.1:4318",
        "--no-deterministic",
        "--reasoning-parser",
        "qwen3",
    ]
    assert main(argv) == 0
    ((args, kwargs),) = calls
    engine_kwargs, host, port, keys, max_queued = args
    assert (host, port, keys.cli, max_queued) == ("0.0.0.0", 31234, ("sk-x",), 7)
    assert kwargs == {
        "served_model_name": None,
        "max_connections": 99,
        "header_timeout_s": 3.0,
        "body_timeout_s": 4.0,
        "max_body_bytes": 1 << 20,
        "grace_period_s": 30.0,
        "otlp_endpoint": "http://127.0.0.1:4318",
        "incremental_streaming_output": False,
        "reasoning_parser": "qwen3",
        "agent_retention": False,
    }
    assert engine_kwargs == {
        "model": str(tiny_model_dir),
        "dtype": "float32",
        "quantization": "int8",
        "device": "cpu",
        "page_size": 1,
        "max_total_tokens": 4096,
        "kv_cache_gb": None,
        "kv_cache_dtype": "int8",
        "context_length": 512,
        "attention_backend": "torch",
        "chunked_prefill_size": 64,
        "schedule_policy": "fcfs",
        "fair_share": True,
        "prefill_merge_tokens": None,
        "max_running_requests": 64,
        "enable_radix_cache": False,
        "enable_partial_page_reuse": True,
        "overlap_schedule": None,
        "enable_jump_forward": True,
        "sampling_defaults": "model",
        "init_new_token_ratio": 0.7,
        "speculative": "ngram",
        "speculative_max_tokens": 5,
        "kv_cache_dir": None,
        "kv_cache_disk_gb": 0.5,
        "kv_cache_host_gb": 0.0,
        "max_pinned_share": 0.25,
        "max_retained_share": 0.4,
        "max_retained_share_per_tenant": 0.2,
        "tp": 1,
        "null_model": False,
        "deterministic": False,
    }
    from radixserve import Engine

    with Engine(**engine_kwargs) as eng:  # every key is one the Engine takes
        assert eng.model_info()["page_size"] == 1 and eng.model_info()["quantization"] == "int8"
        assert eng.model_info()["deterministic"] is False
        assert eng.model_info()["kv_cache_dtype"] == "int8"


def test_kv_cache_dtype_choices_are_the_formats() -> None:
    """cli_args spells the KV formats out (it imports no torch): they must be kv_format's."""
    from radixserve.cache.kv_format import KV_DTYPES
    from radixserve.cli_args import build_parser

    (action,) = [
        a for a in build_parser()._subparsers._group_actions[0].choices["serve"]._actions if a.dest == "kv_cache_dtype"
    ]
    assert tuple(action.choices) == KV_DTYPES


def test_generate_prints_the_greedy_answer(tiny_model_dir: Path, make_engine: Callable, capsys) -> None:
    prompt = "Hello, world! How are you"
    want = make_engine(tiny_model_dir).generate(prompt, {"max_new_tokens": 6, "temperature": 0})
    code = main(["generate", "--model", str(tiny_model_dir), "--dtype", "float32", "--max-new-tokens", "6", prompt])
    out, err = capsys.readouterr()
    assert code == 0
    assert out == want["text"] + "\n"
    n = want["meta_info"]["completion_tokens"]
    assert re.search(rf"\[{n} tokens \| ttft [\d.]+s \| [\d.]+ tok/s \| cached 0/\d+ prompt tokens", err), err


@pytest.mark.slow
def test_chat_in_a_pty_reuses_the_cache_on_turn_two(tiny_model_dir: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    child = pexpect.spawn(
        sys.executable,
        [
            "-m",
            "radixserve.cli",
            "chat",
            "--model",
            str(tiny_model_dir),
            "--dtype",
            "float32",
            "--max-new-tokens",
            "8",
            "--temperature",
            "0",
            "--system",
            "You are terse.",
        ],
        cwd=str(REPO),
        env=env,
        encoding="utf-8",
        timeout=120,
    )
    try:
        child.expect(">>> ")
        cached = []
        for message in ("Hello, world! How are you today?", "Tell me about the fox and the dog."):
            child.sendline(message)
            child.expect(r"cached (\d+)/(\d+) prompt tokens")
            cached.append((int(child.match.group(1)), int(child.match.group(2))))
            child.expect(">>> ")
        child.sendline("exit")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0
    (hit1, prompt1), (hit2, prompt2) = cached
    assert hit1 == 0 and prompt2 > prompt1
    assert hit2 >= prompt1 // 16 * 16 > 0  # at least the first turn's full pages came from the radix cache


def test_every_option_has_help_and_version_prints(capsys) -> None:
    import argparse

    from radixserve import __version__
    from radixserve.cli_args import build_parser

    missing = []

    def walk(parser: argparse.ArgumentParser, path: list[str]) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, [*path, name])
            elif action.option_strings and not action.help:
                missing.append((path, action.option_strings))

    walk(build_parser(), [])
    assert not missing, f"options without help: {missing}"
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"radixserve {__version__}"


def test_engine_flags_cover_every_engine_config_field(tiny_model_dir: Path) -> None:
    """The CLI and EngineConfig cannot drift: every field has a flag (serve adds the queue limit), every flag a field."""
    from dataclasses import fields

    from radixserve.cli_args import build_parser, engine_kwargs
    from radixserve.engine_config import EngineConfig

    args = build_parser().parse_args(["serve", "--model", str(tiny_model_dir)])
    served = set(engine_kwargs(args, tiny_model_dir)) | {"max_queued_requests"}
    assert served == {f.name for f in fields(EngineConfig)}
    EngineConfig(**engine_kwargs(args, tiny_model_dir))  # and every default the CLI passes is valid
