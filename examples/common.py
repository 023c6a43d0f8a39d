"""What the examples share: pick a backend from the command line, and report the cache hit rate of a run."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import frontend_dsl as sgl  # noqa: E402


def parse_args(description: str, extra: dict[str, Any] | None = None) -> argparse.Namespace:
    """--model PATH (default: the default Qwen model), --url URL (a running radixserve server instead), + extras."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", default=None, help="model folder or .gguf (default: Qwen2.5-Coder-0.5B-Instruct)")
    p.add_argument("--url", default=None, help="use a running radixserve server at this URL instead")
    p.add_argument("--api-key", default=None, help="the server's API key, if it has one")
    for flag, kwargs in (extra or {}).items():
        p.add_argument(flag, **kwargs)
    return p.parse_args()


@contextmanager
def open_backend(args: argparse.Namespace) -> Iterator[sgl.Backend]:
    """A RuntimeEndpoint for --url, else an in-process Runtime on --model (shut down when the block ends)."""
    if args.url:
        yield sgl.RuntimeEndpoint(args.url, api_key=args.api_key)
        return
    with sgl.Runtime(args.model) as runtime:
        yield runtime


class HitRate:
    """Cache hit rate over a stretch of work: prompt tokens served from the radix cache / prompt tokens."""

    def __init__(self, backend: sgl.Backend) -> None:
        self.backend = backend
        self.start = backend.cache_stats()

    def report(self) -> str:
        now = self.backend.cache_stats()
        hit = now["hit_tokens"] - self.start["hit_tokens"]
        prompt = now["prompt_tokens"] - self.start["prompt_tokens"]
        rate = hit / prompt if prompt else 0.0
        return f"cache hit rate: {rate:.1%} ({hit} of {prompt} prompt tokens served from the radix cache)"
