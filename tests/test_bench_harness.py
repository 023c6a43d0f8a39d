"""The comparison harness (benchmarks/compare): its pure parts on their own, and a smoke run on the tiny model that
starts real radixserve (and transformers) servers, so the harness cannot silently rot. llama.cpp and guidellm are not
needed: the harness skips an engine that is not installed, and says why."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.compare import engines, fork, report, workloads
from benchmarks.compare.__main__ import main
from benchmarks.compare.client import Result
from benchmarks.compare.metrics import best_hit_tokens, summarize


class CharTokenizer:
    """One token per character; the chat template is `role:content|` per message."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return "".join(f"{m['role']}:{m['content']}|" for m in messages) + (
            "assistant:" if add_generation_prompt else ""
        )


def result(
    sent: float, end: float, prompt: str, text: str = "", completion: int = 4, cached: int | None = 0, tag: str = ""
) -> Result:
    return Result(0, 0, tag, completion, sent, 0.1, end, len(prompt), completion, cached, None, prompt, text)


def test_best_hit_counts_earlier_prompts_and_finished_answers() -> None:
    tok = CharTokenizer()
    rs = [
        result(0.0, 1.0, "abcdef", text="XY"),
        result(0.5, 2.0, "abcdzz"),  # sent while the first ran: shares its prompt "abcd" only
        result(1.5, 3.0, "abcdefXYq"),  # the first had ended: its prompt + answer "abcdefXY"
        result(1.6, 3.0, "abcdefXY"),
    ]  # wholly seen: its last token is still computed
    best, total = best_hit_tokens(tok, rs)
    assert total == 6 + 6 + 9 + 8
    assert best == 0 + 4 + 8 + 7


def test_best_hit_reads_chat_prompts_through_the_template() -> None:
    tok = CharTokenizer()
    first = [{"role": "system", "content": "S"}, {"role": "user", "content": "u1"}]
    a = Result(0, 0, "", 2, 0.0, 0.1, 1.0, 0, 2, 0, first, None, "A")
    b = Result(
        0,
        1,
        "",
        2,
        1.0,
        1.1,
        2.0,
        0,
        2,
        0,
        first + [{"role": "assistant", "content": "A"}, {"role": "user", "content": "u2"}],
        None,
        "B",
    )
    best, total = best_hit_tokens(tok, [a, b])
    # b's prompt begins with a's prompt + answer ("system:S|user:u1|assistant:" + "A")
    assert best == len("system:S|user:u1|assistant:A")
    assert total == len("system:S|user:u1|assistant:") + len("system:S|user:u1|assistant:A|user:u2|assistant:")


def test_summarize_figures() -> None:
    rs = [
        result(0.0, 1.0, "x" * 10, completion=5, cached=4, tag="turn 1"),
        result(0.0, 2.0, "x" * 10, completion=5, cached=0, tag="turn 2"),
        result(1.0, 2.0, "x" * 10, completion=0, cached=0, tag="prefill"),
    ]
    row = summarize(rs, wall=2.0)
    assert row["requests"] == 3 and row["req_s"] == 1.5
    assert row["output_tok_s"] == 5.0
    assert row["prompt_tokens"] == 30 and row["cached_tokens"] == 4 and row["computed_tokens"] == 26
    assert row["ttft_p50_ms"] == pytest.approx(100.0)  # the prefill-only request has no first token: left out
    assert row["itl_p50_ms"] == pytest.approx(1e3 * (1.5 - 0.1) / 4)  # requests 1.0 s and 2.0 s: (0.9 + 1.9) / 2 / 4
    assert set(row["by_tag"]) == {"turn 1", "turn 2"}
    unknown = summarize([result(0.0, 1.0, "x", cached=None)], wall=1.0)
    assert unknown["hit_rate"] is None and unknown["computed_tokens"] is None


def test_fork_stages_follow_overlap() -> None:
    c = fork.Call
    calls = [
        c("p", 0, 0.0, 1.0),
        c("b1", 8, 1.1, 2.0),
        c("b2", 8, 1.2, 2.5),
        c("b3", 8, 1.3, 2.2),
        c("merge", 16, 2.6, 3.0),
    ]
    groups = fork.stages(calls[::-1])
    assert [[x.prompt for x in g] for g in groups] == [["p"], ["b1", "b2", "b3"], ["merge"]]
    (session,) = fork.sessions([calls])
    assert [[s.tag for s in st] for st in session.stages] == [["prefill"], ["branch"] * 3, ["merge"]]
    assert session.stages[0][0].max_tokens == 0


def test_workloads_have_the_sizes_asked(tiny_model_dir: Path) -> None:
    from radixserve.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tiny_model_dir)
    size = workloads.SIZES["smoke"]
    sessions, conc = workloads.multiturn(tok, size)
    assert len(sessions) == size.conversations and conc == size.conversation_concurrency
    assert all(len(s.stages) == size.turns and s.system == sessions[0].system for s in sessions)
    assert len(tok.encode(sessions[0].system)) >= size.system_tokens
    sessions, _ = workloads.rag(tok, size)
    assert len(sessions) == size.documents * size.questions_per_document
    assert len({s.system for s in sessions}) == size.documents
    assert [s.stages[0][0].tag for s in sessions[:2]] == ["doc 1", "doc 2"]  # interleaved across documents
    sessions, _ = workloads.nosharing(tok, size)
    prompts = [s.stages[0][0].prompt for s in sessions]
    assert len(set(prompts)) == len(prompts) == size.nosharing_prompts


def test_resize_overrides_fields() -> None:
    size = workloads.resize(workloads.SIZES["full"], ["conversation_concurrency=1", "micro_batches=1,2"])
    assert size.conversation_concurrency == 1 and size.micro_batches == (1, 2)
    assert size.turns == workloads.SIZES["full"].turns
    with pytest.raises(ValueError, match="FIELD=VALUE"):
        workloads.resize(size, ["no_such_field=3"])


def test_llama_slots_default_to_the_largest_micro_batch() -> None:
    size = workloads.resize(workloads.SIZES["quick"], ["micro_batches=1,8"])
    assert workloads.llama_slots(size) == 8
    fewer = workloads.resize(size, ["micro_llama_slots=4"])
    assert workloads.llama_slots(fewer) == 4
    engine = {"prefill_tok_s": 1.0, "decode_tok_s": {"8": 2.0}}
    micro = {"bandwidth_gb_s": 20.0, "threads": 2, "llama_slots": 4, "engines": {"llama": engine}}
    assert "llama-server's slots (-np): 4" in report.micro_table(micro)
    assert "slots" not in report.micro_table(micro | {"engines": {"radix": engine}})


def test_goal_verdicts() -> None:
    row = {"ttft_p50_ms": 100.0, "ttft_p95_ms": 400.0, "output_tok_s": 50.0, "hit_rate": 0.8, "best_hit_rate": 0.82}
    doc = {
        "workloads": {
            "multiturn": {"radix": row, "llama": {"ttft_p50_ms": 400.0, "ttft_p95_ms": 900.0, "output_tok_s": 40.0}},
            "nosharing": {
                "radix": {"output_tok_s": 10.0, "ttft_p50_ms": 100.0},
                "radix-nocache": {"output_tok_s": 10.2, "ttft_p50_ms": 99.0},
            },
        },
        "micro": {
            "engines": {
                "radix": {"decode_tok_s": {"1": 10.0, "16": 90.0}},
                "llama": {"decode_tok_s": {"1": 30.0, "16": 80.0}},
            }
        },
    }
    verdicts = {g: v for g, _, v in report.goals(doc)}
    assert verdicts["multiturn: radix TTFT p50 <= 1/3 of llama.cpp's"] == "met"
    assert verdicts["multiturn: radix TTFT p95 <= 1/3 of llama.cpp's"] == "gap"
    assert verdicts["multiturn: radix output tok/s >= llama.cpp's"] == "met"
    assert verdicts["multiturn: radix hit rate >= 95% of best possible"] == "met"
    assert verdicts["nosharing: cache on within 5% of off (out tok/s, TTFT p50)"] == "met"
    assert verdicts["decode batch 1 >= 1/2 of llama.cpp's"] == "gap"
    assert verdicts["decode batch 16 ahead of llama.cpp"] == "met"


def test_speed_goal_verdicts() -> None:
    def run(ttft: float, p95: float, wall: float, peak: float) -> dict:
        return {"ttft_p50_ms": ttft, "ttft_p95_ms": p95, "wall_s": wall, "peak_rss_mb": peak}

    doc = {
        "workloads": {"multiturn": {"radix": run(100.0, 340.0, 50.0, 900.0), "llama": run(300.0, 1000.0, 40.0, 500.0)}},
        "micro": {
            "engines": {
                "radix": {"decode_tok_s": {"1": 30.0, "8": 80.0}, "prefill_tok_s": 900.0, "peak_rss_mb": 1400.0},
                "llama": {"decode_tok_s": {"1": 30.0, "8": 60.0}, "prefill_tok_s": 500.0, "peak_rss_mb": 600.0},
            }
        },
    }
    got = {g: (m, v) for g, m, v in report.speed_goals(doc)}
    assert got["decode, 1 stream >= 1.0x"] == ("1.00x", "met")
    assert got["decode, 8 streams >= 1.5x"] == ("1.33x", "gap")
    assert got["prefill tok/s >= 1.5x"] == ("1.80x", "met")
    assert got["multi-turn TTFT p50 <= 0.5x"] == ("0.33x", "met")
    assert got["multi-turn TTFT p95 <= 0.33x"] == ("0.34x", "gap")
    assert got["multi-turn workload wall <= 1.0x"] == ("1.25x", "gap")
    assert got["peak RSS <= 1.5x"] == ("2.33x", "gap")  # each engine's highest peak over the run's servers


def test_llama_server_binary_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    binary = tmp_path / "llama-server"
    binary.write_text("")
    monkeypatch.setenv("LLAMA_SERVER", str(binary))
    assert engines.llama_server_binary() == binary
    monkeypatch.setenv("LLAMA_SERVER", str(tmp_path / "missing"))
    assert engines.llama_server_binary() is None  # an explicit path is not second-guessed
    monkeypatch.delenv("LLAMA_SERVER")
    monkeypatch.setattr(engines, "PEERS_LLAMA_SERVER", binary)
    assert engines.llama_server_binary() == binary


def test_llama_is_skipped_without_a_gguf(tmp_path: Path) -> None:
    models = engines.Models(None, tmp_path)
    assert "GGUF" in engines.unavailable_reason("llama", models)
    assert engines.unavailable_reason("radix", models) is None
    assert "unknown engine" in engines.unavailable_reason("vllm", models)


@pytest.mark.slow
def test_smoke_run_on_the_tiny_model(tiny_model_dir: Path, tmp_path: Path) -> None:
    """multiturn, fork and micro on radixserve (cache on and off) for real; llama.cpp asked for but skipped (no GGUF)."""
    out = tmp_path / "out"
    assert (
        main(
            [
                "--workload",
                "multiturn,fork,micro",
                "--size",
                "smoke",
                "--engines",
                "radix,radix-nocache,llama",
                "--gguf",
                "none",
                "--hf-dir",
                str(tiny_model_dir),
                "--out",
                str(out),
                "--no-plots",
            ]
        )
        == 0
    )
    doc = json.loads((out / "results.json").read_text())
    assert doc["meta"]["engines"] == ["radix", "radix-nocache"]
    size = workloads.SIZES["smoke"]
    mt = doc["workloads"]["multiturn"]
    for e in ("radix", "radix-nocache"):
        assert "error" not in mt[e], mt[e]
        assert mt[e]["requests"] == size.conversations * size.turns
        assert mt[e]["output_tokens"] == size.conversations * sum(size.answer_tokens[: size.turns])
        assert set(mt[e]["by_tag"]) == {f"turn {t + 1}" for t in range(size.turns)}
        assert mt[e]["peak_rss_mb"] > 0
    assert mt["radix-nocache"]["hit_rate"] == 0.0
    assert 0 < mt["radix"]["hit_rate"] <= mt["radix"]["best_hit_rate"]  # token granularity bounds page granularity
    fk = doc["workloads"]["fork"]
    assert "error" not in fk["radix"] and fk["radix"]["requests"] == fk["radix-nocache"]["requests"] >= 5
    assert fk["radix"]["hit_rate"] > 0 and doc["dsl"]["radix"]["hit_rate"] > 0
    micro = doc["micro"]["engines"]["radix"]
    assert micro["prefill_tok_s"] > 0 and set(micro["decode_tok_s"]) == {str(b) for b in size.micro_batches}
    assert micro["ceiling_tok_s"] > 0
    md = (out / "results.md").read_text()
    assert "**multiturn**" in md and "**micro**" in md


@pytest.mark.slow
def test_smoke_run_transformers_and_plots(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The transformers baseline server on the tiny model, and the plots of a run."""
    pytest.importorskip("matplotlib")
    out = tmp_path / "out"
    assert (
        main(
            [
                "--workload",
                "rag",
                "--size",
                "smoke",
                "--engines",
                "hf",
                "--hf-dir",
                str(tiny_model_dir),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    doc = json.loads((out / "results.json").read_text())
    row = doc["workloads"]["rag"]["hf"]
    assert "error" not in row, row
    size = workloads.SIZES["smoke"]
    assert row["output_tokens"] == size.documents * size.questions_per_document * size.rag_answer_tokens
    assert row["cached_tokens"] == 0 and row["best_hit_rate"] > 0
    for name in ("rag_ttft_per_step.png", "workloads_summary.png"):
        assert (out / name).stat().st_size > 1000


def test_guidellm_shim_drops_continuous_usage_stats_only() -> None:
    """The shim forwards method, path and body to the target, without stream_options.continuous_usage_stats."""
    import httpx
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from benchmarks.compare.guidellm_run import Shim
    from radixserve.server.background import BackgroundServer

    async def echo(request: Request) -> JSONResponse:
        return JSONResponse({"path": request.url.path, "body": await request.json()}, status_code=201)

    target = Starlette(routes=[Route("/{path:path}", echo, methods=["POST"])])
    body = {"messages": [], "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with BackgroundServer(target) as server, Shim(server.url) as shim:
        resp = httpx.post(shim.url + "/v1/chat/completions", json=body, timeout=30)
    assert resp.status_code == 201
    assert resp.json() == {
        "path": "/v1/chat/completions",
        "body": {"messages": [], "stream_options": {"include_usage": True}},
    }
