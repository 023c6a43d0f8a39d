"""DSL backends: Runtime (an in-process Engine), RuntimeEndpoint (a radixserve server over HTTP), OpenAI (any
OpenAI-compatible server)."""

from frontend_dsl.backends.base import Backend
from frontend_dsl.backends.endpoint import RuntimeEndpoint
from frontend_dsl.backends.openai import OpenAI
from frontend_dsl.backends.runtime import Runtime

__all__ = ["Backend", "OpenAI", "Runtime", "RuntimeEndpoint"]
