"""`sgl.global_config`: SGLang's process-wide frontend settings, those that mean something here.

skip_special_tokens_in_output and spaces_between_special_tokens_in_out are sent with every gen that leaves them
unset (as SGLang's RuntimeEndpoint sends them); default_backend is the one set_default_backend sets. SGLang's
tracing/precache switches are left out: radixserve's radix cache shares prefixes whatever a client does."""

from __future__ import annotations

from typing import Any

from frontend_dsl import default_backend


class GlobalConfig:
    def __init__(self) -> None:
        self.skip_special_tokens_in_output = True
        self.spaces_between_special_tokens_in_out = True

    @property
    def default_backend(self) -> Any:
        return default_backend.current()

    @default_backend.setter
    def default_backend(self, backend: Any) -> None:
        default_backend.set_default_backend(backend)

    def output_params(self) -> dict[str, bool]:
        """The sampling params these settings add to a gen, where they differ from the server's defaults (so a
        backend that has no such params, an OpenAI one, is sent none unless they are changed)."""
        out = {
            "skip_special_tokens": self.skip_special_tokens_in_output,
            "spaces_between_special_tokens": self.spaces_between_special_tokens_in_out,
        }
        return {k: v for k, v in out.items() if not v}


global_config = GlobalConfig()
