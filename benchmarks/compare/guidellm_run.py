"""guidellm (installed in .peers/ by scripts/install_peers.sh) as a second client, for the workloads it can express
with its synthetic data: multi-turn chat with a shared prefix (answers written back), shared-prefix RAG, no sharing.

guidellm always sends vLLM's `stream_options.continuous_usage_stats`, which radixserve's strict request schema refuses
(HTTP 400). So guidellm talks to every engine alike through a loopback shim that drops that one field and streams the
answer back untouched; the shim costs each engine the same hop.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from benchmarks.compare.engines import REPO
from benchmarks.compare.workloads import Size
from radixserve.server.background import BackgroundServer

GUIDELLM = REPO / ".peers" / "venv" / "bin" / "guidellm"
WORKLOADS = ("multiturn", "rag", "nosharing")


def available() -> bool:
    return GUIDELLM.exists()


class Shim(BackgroundServer):
    """A loopback proxy to `target` that removes stream_options.continuous_usage_stats from JSON bodies; serves from
    a thread of this process while entered (`url` is its address)."""

    def __init__(self, target: str) -> None:
        self.target = target
        # a fresh loopback connection per request: a pooled one the server has since closed fails the request
        self.client = httpx.AsyncClient(base_url=target, timeout=3600, limits=httpx.Limits(max_keepalive_connections=0))
        super().__init__(Starlette(routes=[Route("/{path:path}", self.forward, methods=["GET", "POST"])]))

    async def forward(self, request: Request) -> Response:
        body = await request.body()
        if body:
            obj = json.loads(body)
            (obj.get("stream_options") or {}).pop("continuous_usage_stats", None)
            body = json.dumps(obj).encode()
        req = self.client.build_request(
            request.method,
            request.url.path,
            content=body or None,
            headers={"content-type": request.headers.get("content-type", "application/json")},
        )
        resp = await self.client.send(req, stream=True)
        return StreamingResponse(
            resp.aiter_raw(),
            status_code=resp.status_code,
            media_type=resp.headers.get("content-type"),
            background=BackgroundTask(resp.aclose),
        )


def scenario(workload: str, size: Size, target: str, tokenizer: Path, out: Path) -> dict[str, Any]:
    """guidellm's scenario for one workload, shaped like the replay client's version of it."""
    if workload == "multiturn":
        data = {
            "prompt_tokens": size.user_tokens,
            "output_tokens": sum(size.answer_tokens) // len(size.answer_tokens),
            "output_tokens_min": min(size.answer_tokens),
            "output_tokens_max": max(size.answer_tokens),
            "output_tokens_stdev": 8,
            "turns": size.turns,
            "prefix_tokens": size.system_tokens,
            "prefix_count": 1,
        }
        streams, requests = size.conversation_concurrency, size.conversations * size.turns
    elif workload == "rag":
        data = {
            "prompt_tokens": size.question_tokens,
            "output_tokens": size.rag_answer_tokens,
            "prefix_tokens": size.document_tokens,
            "prefix_count": size.documents,
        }
        streams, requests = size.rag_concurrency, size.documents * size.questions_per_document
    elif workload == "nosharing":
        data = {"prompt_tokens": size.nosharing_tokens, "output_tokens": size.nosharing_answer_tokens}
        streams, requests = size.nosharing_concurrency, size.nosharing_prompts
    else:
        raise ValueError(f"guidellm does not run {workload!r}")
    return {
        "spec": {
            "backend": {"kind": "openai_http", "target": target, "request_format": "/v1/chat/completions"},
            "profile": {"kind": "concurrent", "streams": streams},
            "data": [{"kind": "synthetic_text", **data}],
            "tokenizer": {"kind": "hf_auto", "model": str(tokenizer)},
            "constraints": [{"kind": "max_requests", "count": requests}],
            "outputs": [{"kind": "json", "path": str(out)}],
        }
    }


def _stat(metrics: dict[str, Any], name: str, key: str) -> float | None:
    d = (metrics.get(name) or {}).get("successful") or {}
    if key == "p95":
        return (d.get("percentiles") or {}).get("p95")
    return d.get(key)


def run(workload: str, size: Size, url: str, tokenizer: Path, out_dir: Path) -> dict[str, Any]:
    """Run guidellm on one workload against the server at url; its TTFT p50/p95, ITL p50, requests/s, output tok/s."""
    out_dir = out_dir.resolve()  # guidellm runs in out_dir: relative paths would point elsewhere
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"guidellm-{workload}-{int(time.time())}.json"
    scen = out_dir / f"{out.stem}-scenario.json"
    with Shim(url) as shim:
        scen.write_text(json.dumps(scenario(workload, size, shim.url, tokenizer, out)))
        proc = subprocess.run(
            [str(GUIDELLM), "run", "--scenario", str(scen), "--disable-console"],
            capture_output=True,
            text=True,
            timeout=7200,
            cwd=out_dir,
            env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PATH": "/usr/bin:/bin"},
        )
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"guidellm failed ({proc.returncode}): {proc.stderr[-1500:]}")
    bench = json.loads(out.read_text())["benchmarks"][0]
    m = bench["metrics"]
    reqs = bench["requests"]
    return {
        "ttft_p50_ms": _stat(m, "time_to_first_token_ms", "median"),
        "ttft_p95_ms": _stat(m, "time_to_first_token_ms", "p95"),
        "itl_p50_ms": _stat(m, "inter_token_latency_ms", "median"),
        "req_s": _stat(m, "requests_per_second", "mean"),
        "output_tok_s": _stat(m, "output_tokens_per_second", "mean"),
        "successful": len(reqs.get("successful") or []),
        "errored": len(reqs.get("errored") or []),
        "raw": str(out),
    }
