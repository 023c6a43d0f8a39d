"""radixserve: an LLM serving engine built around a radix tree of token-hashed KV pages."""

import os
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

# OpenMP threads that spin at every barrier lose their core to any other runnable thread (the engine's own Python
# threads, a client, other jobs): measured 5-10x slower decode steps on 2 busy cores. Sleeping idle threads cost
# little. libgomp reads this when torch loads, so it must be set before the first `import torch`.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from radixserve.io import FinishReason, GenerateOutput, GenerateRequest, StreamChunk  # no torch: stays light

if TYPE_CHECKING:
    from radixserve.engine import Engine

__all__ = ["Engine", "FinishReason", "GenerateOutput", "GenerateRequest", "StreamChunk", "__version__"]

try:
    __version__ = version("radixserve")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0.0.0+source"


def __getattr__(name: str) -> Any:
    # Lazy: `radixserve --help` and CLI errors should not wait for torch to import.
    if name == "Engine":
        from radixserve.engine import Engine

        return Engine
    raise AttributeError(f"module 'radixserve' has no attribute {name!r}")
