"""RuntimeEndpoint: a radixserve HTTP server as a DSL backend, over its native routes.

Routes used: POST /generate (text or input_ids, SSE when streaming), POST /tokenize (select's token boundaries),
GET /get_model_info (the chat template and special tokens, for roles), GET /server_info (whether streams send
deltas or the text so far), GET /metrics, POST /flush_cache.
Every request has a timeout, and any failure (unreachable, timeout, HTTP error status) raises BackendError.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from frontend_dsl.backends.base import Backend
from frontend_dsl.backends.http import HttpClient
from frontend_dsl.errors import BackendError

_SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")


class RuntimeEndpoint(Backend):
    def __init__(self, base_url: str, api_key: str | None = None, timeout_s: float = 300.0) -> None:
        """Connect to a radixserve server (checked now: an unreachable server raises BackendError here).
        timeout_s bounds every request (for a stream: the wait for each next chunk)."""
        super().__init__()
        self.http = HttpClient(base_url, api_key, timeout_s)
        self.base_url = self.http.base_url
        self.model_info = self.http.json("GET", "/get_model_info")
        self.server_info = self.http.json("GET", "/server_info")
        # SGLang's flag: without it a stream's events hold everything so far, which generate_stream turns into deltas
        self.incremental = bool(self.server_info.get("incremental_streaming_output"))
        self._renderer: Any = None

    # ---- Backend ------------------------------------------------------------------------------------------------

    def generate(
        self,
        *,
        text: str | None = None,
        input_ids: list[list[int]] | None = None,
        sampling_params: dict[str, Any] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        return_text_in_logprobs: bool = False,
    ) -> dict[str, Any] | list[dict[str, Any]]:
        body: dict[str, Any] = {
            "sampling_params": sampling_params or {},
            "return_logprob": return_logprob,
            "logprob_start_len": logprob_start_len,
            "top_logprobs_num": top_logprobs_num,
            "return_text_in_logprobs": return_text_in_logprobs,
        }
        body |= {"text": text} if text is not None else {"input_ids": input_ids}
        return self.http.json("POST", "/generate", body)

    def generate_stream(
        self,
        text: str,
        sampling_params: dict[str, Any],
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        return_text_in_logprobs: bool = False,
    ) -> Iterator[dict[str, Any]]:
        body = {
            "text": text,
            "sampling_params": sampling_params,
            "stream": True,
            "return_logprob": return_logprob,
            "logprob_start_len": logprob_start_len,
            "top_logprobs_num": top_logprobs_num,
            "return_text_in_logprobs": return_text_in_logprobs,
        }
        events = self.http.events("POST", "/generate", body)
        for chunk in events if self.incremental else _deltas(events):
            yield chunk
            if chunk["meta_info"].get("finish_reason") is not None:
                return
        raise BackendError(f"POST {self.base_url}/generate: the stream ended without a finish_reason")

    def tokenize(self, text: str) -> list[int]:
        return self.http.json("POST", "/tokenize", {"prompt": text})["tokens"]

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        if self._renderer is None:
            self._renderer = self._make_renderer()
        return self._renderer.apply_chat_template(messages, add_generation_prompt=False)

    def _make_renderer(self) -> Any:
        """A vocabulary-less radixserve Tokenizer holding the server's chat template, so roles render exactly as the
        server's own chat path renders them (same jinja environment, same special-token variables)."""
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import models

        from radixserve.tokenizer import Tokenizer

        template = self.model_info.get("chat_template")
        if not template:
            raise BackendError(
                f"{self.base_url}/get_model_info has no chat_template: roles (system/user/assistant) "
                "need the model's chat template"
            )
        specials = self.model_info.get("special_tokens") or {}
        config = {"chat_template": template, **{k: specials.get(k) for k in _SPECIAL_TOKENS}}
        return Tokenizer(HFTokenizer(models.BPE()), config)

    def metrics(self) -> dict[str, float]:
        """The server's unlabeled radixserve_* Prometheus samples, named as in Engine.metrics() (counters end in _total)."""
        from prometheus_client.parser import text_string_to_metric_families

        text = self.http.read("GET", "/metrics").decode()
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name.startswith("radixserve_") and not sample.labels:
                    out[sample.name.removeprefix("radixserve_")] = sample.value
        return out

    def cache_stats(self) -> dict[str, Any]:
        m = self.metrics()
        hit, prompt = int(m.get("cached_tokens_total", 0)), int(m.get("prompt_tokens_total", 0))
        return {"hit_tokens": hit, "prompt_tokens": prompt, "hit_rate": hit / prompt if prompt else 0.0}

    def get_server_info(self) -> dict[str, Any]:
        return dict(self.server_info)

    def flush_cache(self) -> bool:
        try:
            self.http.read("POST", "/flush_cache")
        except BackendError as e:
            if e.status is not None and 400 <= e.status < 500:  # refused while requests are running
                return False
            raise
        return True

    def pin(self, text: str) -> dict[str, Any]:
        out = self.http.json("POST", "/cache/pin", {"text": text})
        return {"pinned_tokens": out["pinned_tokens"], "prompt_tokens": out["prompt_tokens"]}

    def unpin(self, text: str) -> bool:
        return bool(self.http.json("POST", "/cache/unpin", {"text": text})["success"])

    def __repr__(self) -> str:
        return f"RuntimeEndpoint({self.base_url!r})"


def _deltas(events: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Cumulative /generate events as the backend's chunks: only what is new (prompt logprobs with the first)."""
    text_len = ids_len = 0
    for ev in events:
        meta = dict(ev["meta_info"])
        for key in _OUTPUT_LISTS:
            if key in meta:
                meta[key] = meta[key][ids_len:]
        if ids_len or text_len:
            for key in _INPUT_LISTS:
                meta.pop(key, None)
        yield {"text": ev["text"][text_len:], "output_ids": ev["output_ids"][ids_len:], "meta_info": meta}
        text_len, ids_len = len(ev["text"]), len(ev["output_ids"])


_OUTPUT_LISTS = ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs")
_INPUT_LISTS = ("input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs")
