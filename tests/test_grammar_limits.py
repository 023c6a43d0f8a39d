"""Grammars past llguidance's limits (issue 33), over HTTP on the tiny model: the reproductions are a 400 naming the
field the client sent, before anything is queued; a grammar that fails deeper ends its request with its own error,
not a 500; the log grows by a few KB per request whatever the client sends; echoed free text (rid) is bounded.
The grammar bombs and the threads that compile: tests/test_grammar_bombs.py."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine_checks import engine_left_at_rest
from grammar_bombs import FAILS_LATER
from radixserve import Engine
from radixserve.constrained import grammar, limits
from radixserve.constrained.grammar import GrammarCompiler
from radixserve.errors import ParamError
from radixserve.log_bounds import bounded_logger
from radixserve.server.app import build_app
from radixserve.server.background import BackgroundServer

ALTERNATION = "root ::= " + " | ".join(f'"w{i}"' for i in range(20000))
RIGHT_RECURSION = "root ::= " + " | ".join(f'"{i}" root' for i in range(2000)) + ' | ""'
ANY_OF = {
    "anyOf": [
        {"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]} for i in range(3000)
    ]
}
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[Engine]:
    with engine_left_at_rest(tiny_model_dir, dtype="float32", max_total_tokens=8192) as eng:
        yield eng


@pytest.fixture(scope="module")
def http(engine: Engine) -> Iterator[httpx.Client]:
    with BackgroundServer(build_app(engine)) as srv, httpx.Client(base_url=srv.url, timeout=120) as c:
        yield c


def _generate(grammar: dict[str, Any], **extra: Any) -> tuple[str, dict[str, Any]]:
    params = {"max_new_tokens": 12, "temperature": 0.0, **grammar}
    return "/generate", {"text": "Answer:", "sampling_params": params, **extra}


def _chat(**extra: Any) -> tuple[str, dict[str, Any]]:
    return "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 12, **extra}


def _tool(parameters: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": "pick", "parameters": parameters}}]


REPRODUCTIONS = {
    "ebnf-20000-alternatives": (_generate({"ebnf": ALTERNATION}), "ebnf"),
    "ebnf-right-recursion-2000": (_generate({"ebnf": RIGHT_RECURSION}), "ebnf"),
    "json_schema-anyOf-3000": (_generate({"json_schema": ANY_OF}), "json_schema"),
    "response_format-anyOf-3000": (
        _chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": ANY_OF}}),
        "response_format",
    ),
    "tools-anyOf-3000": (_chat(tools=_tool(ANY_OF), tool_choice="required"), "tools"),
}


@pytest.mark.parametrize("case", list(REPRODUCTIONS))
def test_grammar_past_the_limits_is_a_400_naming_the_field(http: httpx.Client, engine: Engine, case: str) -> None:
    (path, body), field = REPRODUCTIONS[case]
    before = engine.scheduler.stats.failed
    for _ in range(2):  # the second answer is the cached refusal
        r = http.post(path, json=body)
        assert r.status_code == 400, r.text[:500]
        err = r.json()["error"]
        assert err["param"] == field and err["code"] == "grammar_too_complex", err
        assert "too complex" in err["message"] and "max is 2000" in err["message"], err
        assert len(r.content) < 1000
    assert engine.scheduler.stats.failed == before  # refused before queueing: no request ran and failed


def test_grammar_failing_mid_generation_is_its_own_error(http: httpx.Client, engine: Engine) -> None:
    path, body = _generate({"ebnf": FAILS_LATER})
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text[:500]
    err = r.json()["error"]
    assert err["param"] == "ebnf" and err["code"] == "grammar_too_complex" and "refused token" in err["message"]
    # Streamed, the status line has gone out by then: the error comes in-band, the same one.
    with http.stream("POST", path, json={**body, "stream": True}) as s:
        events = [line for line in s.iter_lines() if line.startswith("data:")]
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2][5:])["error"]
    assert error["param"] == "ebnf" and error["code"] == "grammar_too_complex", error
    # A chat names the field the client sent: a JSON schema in response_format fails as response_format.
    deep = {
        "type": "object",
        "properties": {"a": {"type": "string", "pattern": "^[a-y]{4,6}$"}, "b": ANY_OF},
        "required": ["a", "b"],
        "additionalProperties": False,
    }
    path, chat = _chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": deep}})
    # Greedy, with room to reach "b": sampled at temperature 1 (the chat's default), whitespace tokens could spend
    # the 12 tokens before it and the request ended well (a CI failure).
    r = http.post(path, json={**chat, "temperature": 0, "max_tokens": 64})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text[:500]


def test_log_grows_by_a_few_kb_per_request(http: httpx.Client, caplog: pytest.LogCaptureFixture) -> None:
    bodies = [body for (body, _) in REPRODUCTIONS.values()]
    bodies += [_generate({"ebnf": FAILS_LATER}), _generate({}, rid="r" * 5_000_000)]
    bodies += [_generate({"ebnf": "root ::= (" + "x" * 200_000})]  # a parse error quoting the grammar
    with caplog.at_level(logging.DEBUG):
        for _ in range(2):
            for path, body in bodies:
                assert http.post(path, json=body).status_code == 400
    per_request = len(caplog.text.encode()) / (2 * len(bodies))
    assert per_request < 4096, caplog.text[:2000]
    assert any("refused token" in rec.getMessage() for rec in caplog.records)  # the mid-generation failure is logged


def test_bounded_logger_cuts_long_lines(caplog: pytest.LogCaptureFixture) -> None:
    log = bounded_logger("radixserve.test_grammar_limits")
    with caplog.at_level(logging.INFO):
        try:
            raise RuntimeError("g" * 100_000)
        except RuntimeError as exc:
            log.error("request %s failed", "r" * 100_000, exc_info=exc)
    assert len(caplog.text) < 3000 and "(100014 characters)" in caplog.text  # cut, with the length it had


def test_rid_is_bounded(http: httpx.Client) -> None:
    for rid in ("r" * 5_000_000, "r" * 129, "a\nb", "tab\there", ""):
        path, body = _generate({}, rid=rid)
        r = http.post(path, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "rid", r.text[:300]
        assert len(r.content) < 2000
    ok = "Req-1:some.label/x" + "z" * 110
    path, body = _generate({}, rid=ok)
    r = http.post(path, json=body)
    assert r.status_code == 200 and r.json()["meta_info"]["id"] == ok


def test_engine_bounds_rid_too(engine: Engine) -> None:
    for rid in ("x" * 257, "line\nbreak"):
        with pytest.raises(ParamError) as info:
            engine.generate("hi", {"max_new_tokens": 1}, rid=rid)
        assert info.value.field == "rid"


def test_a_grammar_over_the_compile_budget_is_refused(engine: Engine) -> None:
    strict = GrammarCompiler(engine.tokenizer, engine.model_info()["vocab_size"], [], budget_s=0.0)
    for _ in range(2):  # the refusal is cached like a grammar
        with pytest.raises(ParamError) as info:
            strict.compile("json_schema", {"type": "object"})
        err = info.value
        assert err.field == "json_schema" and err.code == "grammar_too_complex" and "over the budget" in err.message


def test_costly_masks_are_refused_and_costly_forced_runs_sample(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check times the masks and forced runs of its probes: over a step's budget a grammar is refused (it would
    hold every request batched with it); a forced run over its budget turns jump-forward off for the grammar."""
    vocab = engine.model_info()["vocab_size"]
    monkeypatch.setattr(limits, "FORCED_BUDGET_S", -1.0)
    assert not GrammarCompiler(engine.tokenizer, vocab, []).compile("regex", "[a-c]{3}-[0-9]{2}").checked.jump_forward
    monkeypatch.setattr(limits, "MASK_BUDGET_S", -1.0)
    with pytest.raises(ParamError) as info:
        GrammarCompiler(engine.tokenizer, vocab, []).compile("regex", "[a-c]{3}-[0-9]{2}")
    assert info.value.code == "grammar_too_complex" and "a token mask took" in info.value.message


def test_large_ebnf_is_converted_out_of_process(engine: Engine) -> None:
    """A GBNF grammar past EBNF_IN_PROCESS_CHARS is converted in a child process: same grammar, same errors."""
    pad = "".join(f'w{i} ::= "w{i}"\n' for i in range(2000))
    assert len(pad) > grammar.EBNF_IN_PROCESS_CHARS
    big = engine.grammars.compile("ebnf", 'root ::= "yes" | "no"\n' + pad)
    out = engine.generate("x", {"max_new_tokens": 4, "temperature": 0.0, "ebnf": 'root ::= "yes" | "no"\n' + pad})
    assert big.field == "ebnf" and out["text"] in ("yes", "no")
    with pytest.raises(ParamError) as info:
        engine.grammars.compile("ebnf", "root ::= (" + pad)
    assert info.value.field == "ebnf" and "Failed to convert the grammar from GBNF to Lark" in info.value.message
