"""DSL backends: Runtime (an in-process Engine) and RuntimeEndpoint (a radixserve server over HTTP)."""
from frontend_dsl.backends.base import Backend
from frontend_dsl.backends.endpoint import RuntimeEndpoint
from frontend_dsl.backends.runtime import Runtime

__all__ = ["Backend", "Runtime", "RuntimeEndpoint"]
