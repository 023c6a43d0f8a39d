"""radixserve: an LLM serving engine built around a radix tree of token-hashed KV pages."""
from radixserve.engine import Engine

__all__ = ["Engine"]
