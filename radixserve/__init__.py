"""radixserve: an LLM serving engine built around a radix tree of token-hashed KV pages."""
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from radixserve.engine import Engine

__all__ = ["Engine"]


def __getattr__(name: str) -> Any:
    # Lazy: `radixserve --help` and CLI errors should not wait for torch to import.
    if name == "Engine":
        from radixserve.engine import Engine

        return Engine
    raise AttributeError(f"module 'radixserve' has no attribute {name!r}")
