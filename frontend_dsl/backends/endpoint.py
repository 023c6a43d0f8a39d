"""RuntimeEndpoint: a radixserve HTTP server as a DSL backend, over its native routes.

Routes used: POST /generate (text or input_ids, SSE when streaming), POST /tokenize (select's token boundaries),
GET /get_model_info (the chat template and special tokens, for roles), GET /metrics, POST /flush_cache.
Every request has a timeout, and any failure (unreachable, timeout, HTTP error status) raises BackendError.
"""
from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

from frontend_dsl.backends.base import Backend
from frontend_dsl.errors import BackendError

_SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")


def _error_message(body: bytes) -> str:
    """The message of an OpenAI-style error body, else the body's text."""
    try:
        obj = json.loads(body)
    except ValueError:
        return body.decode("utf-8", "replace")[:500]
    if isinstance(obj, dict) and isinstance(obj.get("error"), dict):
        return str(obj["error"].get("message", obj["error"]))
    return str(obj)[:500]


class RuntimeEndpoint(Backend):
    def __init__(self, base_url: str, api_key: str | None = None, timeout_s: float = 300.0) -> None:
        """Connect to a radixserve server (checked now: an unreachable server raises BackendError here).
        timeout_s bounds every request (for a stream: the wait for each next chunk)."""
        super().__init__()
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.model_info = self._json("GET", "/get_model_info")
        self._renderer: Any = None

    # ---- HTTP ---------------------------------------------------------------------------------------------------

    def _open(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        url = self.base_url + path
        headers = {"Accept": "application/json, text/event-stream"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(url, data=data, method=method, headers=headers)
        try:
            return urllib.request.urlopen(req, timeout=self.timeout_s)
        except urllib.error.HTTPError as e:
            raise BackendError(f"{method} {url} failed with HTTP {e.code}: {_error_message(e.read())}",
                               status=e.code) from None
        except urllib.error.URLError as e:
            if isinstance(e.reason, (TimeoutError, socket.timeout)):
                raise BackendError(f"{method} {url}: no answer within {self.timeout_s} s") from None
            raise BackendError(f"cannot reach the radixserve server at {self.base_url}: {e.reason}") from None
        except (TimeoutError, socket.timeout):
            raise BackendError(f"{method} {url}: no answer within {self.timeout_s} s") from None
        except OSError as e:
            raise BackendError(f"{method} {url} failed: {e}") from None

    def _read(self, method: str, path: str, body: dict[str, Any] | None = None) -> bytes:
        with self._open(method, path, body) as resp:
            try:
                return resp.read()
            except (TimeoutError, socket.timeout):
                raise BackendError(f"{method} {self.base_url + path}: answer not complete within "
                                   f"{self.timeout_s} s") from None

    def _json(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        raw = self._read(method, path, body)
        try:
            return json.loads(raw)
        except ValueError:
            raise BackendError(f"{method} {self.base_url + path} answered non-JSON: {raw[:200]!r}") from None

    # ---- Backend ------------------------------------------------------------------------------------------------

    def generate(self, *, text: str | None = None, input_ids: list[list[int]] | None = None,
                 sampling_params: dict[str, Any] | None = None, return_logprob: bool = False,
                 logprob_start_len: int = -1, top_logprobs_num: int = 0) -> dict[str, Any] | list[dict[str, Any]]:
        body: dict[str, Any] = {"sampling_params": sampling_params or {}, "return_logprob": return_logprob,
                                "logprob_start_len": logprob_start_len, "top_logprobs_num": top_logprobs_num}
        body |= {"text": text} if text is not None else {"input_ids": input_ids}
        return self._json("POST", "/generate", body)

    def generate_stream(self, text: str, sampling_params: dict[str, Any], return_logprob: bool = False,
                        logprob_start_len: int = -1, top_logprobs_num: int = 0) -> Iterator[dict[str, Any]]:
        body = {"text": text, "sampling_params": sampling_params, "stream": True, "return_logprob": return_logprob,
                "logprob_start_len": logprob_start_len, "top_logprobs_num": top_logprobs_num}
        url = self.base_url + "/generate"
        with self._open("POST", "/generate", body) as resp:  # leaving early closes the connection: the server aborts
            while True:
                try:
                    line = resp.readline()
                except (TimeoutError, socket.timeout):
                    raise BackendError(f"POST {url}: no stream chunk within {self.timeout_s} s") from None
                if not line:
                    raise BackendError(f"POST {url}: the stream ended before the request finished")
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[len(b"data:"):].strip()
                if payload == b"[DONE]":
                    return
                chunk = json.loads(payload)
                if "error" in chunk:
                    raise BackendError(f"POST {url} failed mid-stream: {_error_message(payload)}")
                yield chunk
                if chunk["meta_info"].get("finish_reason") is not None:
                    return

    def tokenize(self, text: str) -> list[int]:
        return self._json("POST", "/tokenize", {"prompt": text})["tokens"]

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
            raise BackendError(f"{self.base_url}/get_model_info has no chat_template: roles (system/user/assistant) "
                               "need the model's chat template")
        specials = self.model_info.get("special_tokens") or {}
        config = {"chat_template": template, **{k: specials.get(k) for k in _SPECIAL_TOKENS}}
        return Tokenizer(HFTokenizer(models.BPE()), config)

    def metrics(self) -> dict[str, float]:
        """The server's unlabeled radixserve_* Prometheus samples, named as in Engine.metrics() (counters end in _total)."""
        from prometheus_client.parser import text_string_to_metric_families

        text = self._read("GET", "/metrics").decode()
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

    def flush_cache(self) -> bool:
        try:
            self._read("POST", "/flush_cache")
        except BackendError as e:
            if e.status is not None and 400 <= e.status < 500:  # refused while requests are running
                return False
            raise
        return True

    def __repr__(self) -> str:
        return f"RuntimeEndpoint({self.base_url!r})"
