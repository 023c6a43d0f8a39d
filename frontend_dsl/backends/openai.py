"""OpenAI: any OpenAI-compatible server (radixserve, vLLM, llama.cpp, a hosted API) as a DSL backend.

Over /v1/completions (a completion model: the program's text is the prompt) or /v1/chat/completions (a chat model:
the program's closed messages are the prompt, so a gen must open an assistant message, as in SGLang's OpenAI
backend). What the OpenAI API cannot express is refused, not dropped: token-id prompts, prompt-cache control, gen
logprobs, and select on chat models. select on a completion model scores each choice from the prompt logprobs of
one `echo` request (SGLang's OpenAI backend instead forces tokens with logit_bias, which needs the model's tokenizer).
Role text in `state.text()` follows a plain "ROLE: content" layout; a chat model receives the messages themselves.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from frontend_dsl.backends.base import Backend, common_prefix_len, mean_logprob
from frontend_dsl.backends.http import HttpClient
from frontend_dsl.errors import BackendError, NotSupportedError

_STANDARD = {
    "max_new_tokens": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "stop": "stop",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
}
# Extras that open servers accept under these names; sent only when set, so a server without them says so itself.
# (min_new_tokens is min_tokens there, as in SGLang's and vLLM's OpenAI routes.)
_EXTRAS = {"top_k": -1, "min_p": 0.0, "ignore_eos": False, "stop_token_ids": [], "min_new_tokens": 0, "stop_regex": []}
_EXTRA_NAMES = {"min_new_tokens": "min_tokens"}


def openai_body(sampling_params: dict[str, Any]) -> dict[str, Any]:
    """Engine sampling params as OpenAI request fields."""
    body = {_STANDARD[k]: v for k, v in sampling_params.items() if k in _STANDARD}
    body |= {_EXTRA_NAMES.get(k, k): v for k, v in sampling_params.items() if k in _EXTRAS and v != _EXTRAS[k]}
    if sampling_params.get("json_schema") is not None:  # OpenAI's structured outputs
        schema = sampling_params["json_schema"]
        schema = json.loads(schema) if isinstance(schema, str) else schema
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
    unknown = set(sampling_params) - set(_STANDARD) - set(_EXTRAS) - {"json_schema"}
    if unknown:
        raise NotSupportedError(f"sampling parameter(s) {', '.join(sorted(unknown))} have no OpenAI API field")
    return body


def _finish(reason: str | None, usage: dict[str, Any] | None) -> dict[str, Any]:
    """SGLang-shaped meta_info from an OpenAI choice's finish_reason and the response's usage."""
    meta: dict[str, Any] = {"finish_reason": None if reason is None else {"type": reason}}
    if usage:
        meta["prompt_tokens"] = usage.get("prompt_tokens")
        meta["completion_tokens"] = usage.get("completion_tokens")
        meta["cached_tokens"] = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return meta


@dataclass
class TokenUsage:
    """Tokens the server billed across this backend's requests (SGLang's OpenAI backend keeps the same counts)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0


class OpenAI(Backend):
    def __init__(
        self,
        model_name: str,
        is_chat_model: bool | None = None,
        chat_template: Any = None,
        is_azure: bool = False,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        timeout_s: float = 300.0,
    ) -> None:
        """model_name as the server knows it; base_url up to /v1 (default: $OPENAI_BASE_URL or OpenAI's);
        api_key (default: $OPENAI_API_KEY). is_chat_model (default True, as SGLang assumes for model names it does
        not list as instruct models): send messages to /v1/chat/completions instead of text to /v1/completions.
        The positional order is SGLang's; base_url and api_key are what SGLang passes on to the openai client."""
        super().__init__()
        if is_azure:
            raise NotSupportedError(
                "OpenAI(is_azure=True) is not supported: pass the Azure deployment's OpenAI-compatible base_url instead"
            )
        if chat_template is not None:
            raise NotSupportedError(
                "OpenAI(chat_template=...) is not supported: a chat model gets the messages "
                "themselves, and a completion model's role text is a plain ROLE: layout"
            )
        self.model_name = model_name
        self.chat_only = True if is_chat_model is None else is_chat_model
        base = base_url or os.environ.get("OPENAI_BASE_URL") or "https://api.openai.com/v1"
        self.http = HttpClient(base, api_key or os.environ.get("OPENAI_API_KEY"), timeout_s)
        self.token_usage = TokenUsage()
        self._usage_lock = threading.Lock()  # forks and run_batch call from many threads

    def _count(self, usage: dict[str, Any] | None) -> None:
        if usage:
            with self._usage_lock:
                self.token_usage.prompt_tokens += usage.get("prompt_tokens") or 0
                self.token_usage.completion_tokens += usage.get("completion_tokens") or 0

    def _request(self, prompt: str | list[dict[str, str]], sampling_params: dict[str, Any]) -> tuple[str, dict]:
        if self.chat_only:
            return "/chat/completions", {"model": self.model_name, "messages": prompt, **openai_body(sampling_params)}
        return "/completions", {"model": self.model_name, "prompt": prompt, **openai_body(sampling_params)}

    @staticmethod
    def _refuse_logprobs(return_logprob: bool, return_text_in_logprobs: bool) -> None:
        if return_logprob or return_text_in_logprobs:
            raise NotSupportedError(
                "return_logprob on the OpenAI backend is not supported: OpenAI logprobs carry "
                "token strings, not the token ids SGLang's logprob entries hold"
            )

    def generate(
        self,
        *,
        text: str | list[dict[str, str]] | None = None,
        input_ids: list[list[int]] | None = None,
        sampling_params: dict[str, Any] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        return_text_in_logprobs: bool = False,
    ) -> dict[str, Any]:
        if input_ids is not None:
            raise NotSupportedError("the OpenAI backend takes text prompts, not token ids")
        self._refuse_logprobs(return_logprob, return_text_in_logprobs)
        path, body = self._request(text, sampling_params or {})
        out = self.http.json("POST", path, body)
        self._count(out.get("usage"))
        choice = out["choices"][0]
        content = choice["message"]["content"] if self.chat_only else choice["text"]
        return {"text": content or "", "meta_info": _finish(choice.get("finish_reason"), out.get("usage"))}

    def generate_stream(
        self,
        text: str | list[dict[str, str]],
        sampling_params: dict[str, Any],
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        return_text_in_logprobs: bool = False,
    ) -> Iterator[dict[str, Any]]:
        self._refuse_logprobs(return_logprob, return_text_in_logprobs)
        path, body = self._request(text, sampling_params)
        body |= {"stream": True, "stream_options": {"include_usage": True}}
        reason = None
        for event in self.http.events("POST", path, body):
            for choice in event.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content") if self.chat_only else choice.get("text")
                reason = choice.get("finish_reason") or reason
                if piece:
                    yield {"text": piece, "meta_info": {"finish_reason": None}}
            if event.get("usage"):  # the last event, after the one with finish_reason
                self._count(event["usage"])
                yield {"text": "", "meta_info": _finish(reason, event["usage"])}
                return
        yield {"text": "", "meta_info": _finish(reason, None)}

    def prefill(self, text: str) -> None:
        """The OpenAI API has no prefill-only request; a server with a prefix cache fills it on the first request."""

    def score_choices(self, prefix: str, choices: list[str], unconditional: bool = False) -> dict[str, Any]:
        """Prompt logprobs of each choice after prefix, from one /v1/completions request with echo and max_tokens 0:
        prompts [prefix, prefix + choice...]; a choice's tokens are those after its common prefix with prefix's."""
        if self.chat_only:
            raise NotSupportedError(
                "select on an OpenAI chat model is not supported: chat APIs return no prompt "
                "logprobs; use a completion model (OpenAI(..., is_chat_model=False))"
            )
        if unconditional:
            raise NotSupportedError(
                "unconditional_likelihood_normalized on the OpenAI backend is not supported: "
                "it needs each choice scored on the same token ids with and without the prompt"
            )
        body = {
            "model": self.model_name,
            "prompt": [prefix, *(prefix + c for c in choices)],
            "echo": True,
            "max_tokens": 0,
            "logprobs": 0,
        }
        resp = self.http.json("POST", "/completions", body)
        self._count(resp.get("usage"))
        out = sorted(resp["choices"], key=lambda c: c["index"])
        if len(out) != len(choices) + 1:
            raise BackendError(f"scoring {len(choices)} choices returned {len(out)} completions")
        base = out[0]["logprobs"]["tokens"] if prefix else []
        entries = []
        for c in out[1:]:
            tokens, lps = c["logprobs"]["tokens"], c["logprobs"]["token_logprobs"]
            start = common_prefix_len(base, tokens)
            entries.append([(lp, None, tok) for lp, tok in zip(lps[start:], tokens[start:])])
        return {
            "normalized_prompt_logprobs": [mean_logprob(es) for es in entries],
            "input_token_logprobs": entries,
            "output_token_logprobs": [[] for _ in choices],
        }

    def tokenize(self, text: str) -> list[int]:
        raise NotSupportedError("the OpenAI API has no tokenizer endpoint")

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        return "".join(f"{m['role'].upper()}: {m['content']}\n" for m in messages)

    def cache_stats(self) -> dict[str, Any]:
        raise NotSupportedError("the OpenAI API reports no cache statistics (meta_info has each gen's cached_tokens)")

    def flush_cache(self) -> bool:
        raise NotSupportedError("the OpenAI API has no cache control")

    def get_server_info(self) -> dict[str, Any]:
        return {"model_name": self.model_name, "base_url": self.http.base_url, "is_chat_model": self.chat_only}

    def __repr__(self) -> str:
        return f"OpenAI({self.model_name!r}, base_url={self.http.base_url!r})"
