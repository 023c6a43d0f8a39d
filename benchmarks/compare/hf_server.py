"""The plain-transformers baseline as a server: `model.generate()` behind streaming OpenAI-style routes.

    python -m benchmarks.compare.hf_server --model HF_FOLDER --port N [--threads 2] [--max-batch 16]

So that every engine is driven by the same client, transformers gets the smallest server that serves the benchmark:
static batching (requests that arrive while a batch runs wait for the next one; those arriving within a short window
are left-padded into one generate() call), greedy decoding, ignore_eos, no prompt cache. Routes: /health,
/v1/models, /v1/completions, /v1/chat/completions (stream or not; streams end with a usage chunk). max_tokens=0 (prefill only)
has no generate() equivalent: it generates one token and returns none.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from transformers import AutoModelForCausalLM, AutoTokenizer, StoppingCriteria, StoppingCriteriaList

BATCH_WINDOW_S = 0.01  # requests sent together by a client arrive within this window and share one batch
DONE = -1


@dataclass
class Job:
    """One request for the worker; tokens go to `out` (thread-safe), DONE ends it."""

    prompt_ids: list[int]
    max_new_tokens: int
    ignore_eos: bool
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue
    emitted: int = 0
    finished: bool = False

    def push(self, token: int) -> None:
        self.loop.call_soon_threadsafe(self.out.put_nowait, token)


@dataclass
class BatchState:
    """Per-row progress of one generate() call, shared by its streamer and its stopping criterion."""

    jobs: list[Job]
    eos_ids: set[int]
    prompt_seen: bool = False
    done: list[bool] = field(default_factory=list)

    def put(self, value: torch.Tensor) -> None:
        """transformers' streamer hook: first the prompt ids, then each step's new token of every row."""
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        for row, token in enumerate(value.reshape(-1).tolist()):
            job = self.jobs[row]
            if job.finished:
                continue
            if not job.ignore_eos and token in self.eos_ids:
                self.finish(job)
                continue
            if job.emitted < job.max_new_tokens:
                job.push(token)
                job.emitted += 1
            if job.emitted >= job.max_new_tokens:
                self.finish(job)

    def finish(self, job: Job) -> None:
        job.finished = True
        job.push(DONE)

    def end(self) -> None:
        for job in self.jobs:
            if not job.finished:
                self.finish(job)


class RowsDone(StoppingCriteria):
    """Stops each row once its request has all its tokens (generate() pads finished rows until every row is done)."""

    def __init__(self, state: BatchState) -> None:
        self.state = state

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return torch.tensor([j.finished for j in self.state.jobs], dtype=torch.bool, device=input_ids.device)


class Worker:
    """The one thread that runs generate(), a batch at a time."""

    def __init__(self, model: Any, tokenizer: Any, max_batch: int) -> None:
        self.model, self.tokenizer, self.max_batch = model, tokenizer, max_batch
        self.jobs: queue.Queue[Job] = queue.Queue()
        self.eos_ids = set(_as_list(model.generation_config.eos_token_id) + _as_list(tokenizer.eos_token_id))
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.eos_ids, default=0)
        threading.Thread(target=self.run, name="hf-generate", daemon=True).start()

    def run(self) -> None:
        while True:
            batch = [self.jobs.get()]
            deadline = time.monotonic() + BATCH_WINDOW_S
            while len(batch) < self.max_batch:
                try:
                    batch.append(self.jobs.get(timeout=max(0.0, deadline - time.monotonic())))
                except queue.Empty:
                    break
            state = BatchState(batch, self.eos_ids)
            try:
                self.generate(state)
            finally:
                state.end()

    @torch.inference_mode()
    def generate(self, state: BatchState) -> None:
        width = max(len(j.prompt_ids) for j in state.jobs)
        ids = torch.full((len(state.jobs), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, job in enumerate(state.jobs):  # left padding: every row's next token is at the same position
            ids[row, width - len(job.prompt_ids) :] = torch.tensor(job.prompt_ids)
            mask[row, width - len(job.prompt_ids) :] = 1
        steps = max(max(j.max_new_tokens for j in state.jobs), 1)
        self.model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=steps,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=self.pad_id,
            streamer=state,
            stopping_criteria=StoppingCriteriaList([RowsDone(state)]),
        )


def _as_list(x: Any) -> list[int]:
    if x is None:
        return []
    return list(x) if isinstance(x, (list, tuple)) else [int(x)]


def _text(content: Any) -> str:
    """A message's content as text: OpenAI allows a list of parts ({"type": "text", "text": ...})."""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content or ""


class Handler:
    """The HTTP routes; requests become Jobs, their tokens come back through an asyncio queue."""

    def __init__(self, worker: Worker, model_name: str) -> None:
        self.worker, self.model_name = worker, model_name
        self.tok = worker.tokenizer

    async def health(self, request: Request) -> Response:
        return Response("ok")

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": self.model_name, "object": "model"}]})

    async def completions(self, request: Request) -> Response:
        body = await request.json()
        prompt = body["prompt"]
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
        elif isinstance(prompt, str):
            ids = self.tok(prompt, add_special_tokens=True)["input_ids"]
        else:
            return JSONResponse({"error": {"message": "prompt must be a string or a list of token ids"}}, 400)
        return await self.respond(body, ids, chat=False)

    async def chat(self, request: Request) -> Response:
        body = await request.json()
        messages = [dict(m, content=_text(m.get("content"))) for m in body["messages"]]
        ids = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        return await self.respond(body, list(ids), chat=True)

    async def respond(self, body: dict[str, Any], ids: list[int], chat: bool) -> Response:
        limit = body.get("max_tokens", body.get("max_completion_tokens"))
        max_new = 16 if limit is None else int(limit)
        loop = asyncio.get_running_loop()
        job = Job(ids, max_new, bool(body.get("ignore_eos", False)), loop, asyncio.Queue())
        self.worker.jobs.put(job)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:12]}"
        if body.get("stream"):
            return StreamingResponse(self.stream(job, rid, chat), media_type="text/event-stream")
        tokens = []
        while (t := await job.out.get()) != DONE:
            tokens.append(t)
        tokens = tokens if max_new > 0 else []
        text = self.tok.decode(tokens, skip_special_tokens=True)
        choice = {"index": 0, "finish_reason": "length"}
        choice |= {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
        return JSONResponse(
            {
                "id": rid,
                "object": "chat.completion" if chat else "text_completion",
                "model": self.model_name,
                "choices": [choice],
                "usage": self.usage(ids, tokens),
            }
        )

    async def stream(self, job: Job, rid: str, chat: bool) -> Any:
        tokens: list[int] = []
        sent = ""
        while (t := await job.out.get()) != DONE:
            if job.max_new_tokens == 0:
                continue
            tokens.append(t)
            text = self.tok.decode(tokens, skip_special_tokens=True)
            if text.endswith("\ufffd"):  # a partial UTF-8 character: wait for the rest
                continue
            yield self.sse(rid, chat, text[len(sent) :], None)
            sent = text
        text = self.tok.decode(tokens, skip_special_tokens=True)
        yield self.sse(rid, chat, text[len(sent) :], "length")
        yield (
            "data: "
            + json.dumps(
                {
                    "id": rid,
                    "object": "chat.completion.chunk" if chat else "text_completion",
                    "choices": [],
                    "usage": self.usage(job.prompt_ids, tokens),
                }
            )
            + "\n\n"
        )
        yield "data: [DONE]\n\n"

    def sse(self, rid: str, chat: bool, text: str, finish: str | None) -> str:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
        choice |= {"delta": {"content": text}} if chat else {"text": text}
        obj = {
            "id": rid,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "model": self.model_name,
            "choices": [choice],
        }
        return "data: " + json.dumps(obj) + "\n\n"

    @staticmethod
    def usage(prompt_ids: list[int], tokens: list[int]) -> dict[str, Any]:
        return {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": len(tokens),
            "total_tokens": len(prompt_ids) + len(tokens),
            "prompt_tokens_details": {"cached_tokens": 0},
        }


def build_app(model_dir: str, threads: int, max_batch: int, dtype: str) -> Starlette:
    """Load the model and tokenizer from a HF folder and return the app (the worker thread is already running)."""
    torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    model.eval()
    handler = Handler(Worker(model, tokenizer, max_batch), model_dir)
    routes = [
        Route("/health", handler.health),
        Route("/v1/models", handler.models),
        Route("/v1/completions", handler.completions, methods=["POST"]),
        Route("/v1/chat/completions", handler.chat, methods=["POST"]),
    ]
    return Starlette(routes=routes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="Hugging Face folder")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = ap.parse_args()
    app = build_app(args.model, args.threads, args.max_batch, args.dtype)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
