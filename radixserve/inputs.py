"""Requests from the caller's arguments: validated (every bad value a ParamError naming its field), tokenized with
the prompt's size checked first, the model's sampling defaults under what the request sets; and the scheduler's
`Req` built from a validated spec. Runs on the caller's thread, never in the engine loop."""

from __future__ import annotations

import uuid
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from radixserve.cache.retention import DEFAULT_PRIORITY, MAX_PRIORITY, MAX_RETENTION_S, Retention
from radixserve.constrained.grammar import CompiledGrammar, GrammarCompiler, built
from radixserve.errors import ParamError
from radixserve.request import Req
from radixserve.sampling.info import SamplingInfo, SeenIds
from radixserve.sampling.sampler import make_generator
from radixserve.sampling_params import SamplingParams
from radixserve.tokenizer import Tokenizer

# A token of any tokenizer here covers far fewer characters than this: longer prompts cannot fit the context.
CHARS_PER_TOKEN = 32
MAX_BATCH_PROMPTS = 256  # prompts in one call (each n samples more): bounds the work one call can queue
MAX_WANTED_IDS = 1024  # token_ids_logprob ids per prompt: each costs a gather per position
# A rid is echoed in every output and named in log lines: bounded and printable (the HTTP server's own ids add ~40
# characters to a client's label of at most 128, radixserve/server/protocol.py).
MAX_RID_CHARS = 256


@dataclass(frozen=True)
class RequestSpec:
    """One request to submit: validated, tokenized, not yet queued."""

    input_ids: list[int]
    params: SamplingParams
    rid: str
    cache_salt: str
    return_logprob: bool
    logprob_start_len: int
    top_logprobs_num: int
    priority: int = 0  # higher runs first, and may retract lower-priority requests (radixserve/scheduler/fairness.py)
    timeout: float | None = None  # seconds from submission after which the request is aborted; None: never
    tenant: str | None = None  # whose fair share the request's prefill counts against; None: its cache_salt
    grammar: CompiledGrammar | None = None  # what the output must match (validated, cached by its text)
    token_ids_logprob: tuple[int, ...] = ()  # ids whose logprobs every position reports (with return_logprob)
    retention: Retention | None = None  # keep its cached prefix ahead of LRU once it finishes (cache/retention.py)


class RequestBuilder:
    """Checks and tokenizes requests for one engine (its tokenizer, vocabulary, context, KV pool and defaults)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        context_length: int,
        pool_tokens: int,
        sampling_defaults: dict[str, Any],
        grammars: GrammarCompiler | None = None,
        eos_ids: frozenset[int] = frozenset(),
    ) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids  # held off with the stop ids while a request is under its min_new_tokens
        self.grammars = grammars
        self.vocab_size = vocab_size
        self.context_length = context_length
        self.pool_tokens = pool_tokens
        self.sampling_defaults = sampling_defaults
        self.max_prompt_chars = CHARS_PER_TOKEN * context_length
        self.max_batch_prompts = MAX_BATCH_PROMPTS

    def specs(
        self,
        prompt: str | list[str] | None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | SamplingParams | None,
        input_ids: list[int] | list[list[int]] | None,
        return_logprob: bool,
        logprob_start_len: int,
        top_logprobs_num: int,
        cache_salt: str,
        rid: str | list[str] | None,
        priority: int = 0,
        timeout: float | None = None,
        tenant: str | None = None,
        token_ids_logprob: Any = None,
        retention_seconds: Any = None,
        retention_priority: Any = DEFAULT_PRIORITY,
    ) -> tuple[list[RequestSpec], bool]:
        """Validate and tokenize; returns the specs and whether the caller passed a single prompt."""
        if (prompt is None) == (input_ids is None):
            raise ParamError("prompt", "pass exactly one of prompt or input_ids")
        if prompt is not None:
            single = isinstance(prompt, str)
            ids_list = self.encode_prompts(prompt)
        else:
            single, ids_list = self.id_lists(input_ids)
        if len(ids_list) > self.max_batch_prompts:
            raise ParamError("prompt", f"a batch holds at most {self.max_batch_prompts} prompts, got {len(ids_list)}")
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(ids_list):
                raise ParamError("sampling_params", "sampling_params list must have one entry per prompt")
            params = [self.params(p) for p in sampling_params]
        else:
            params = [self.params(sampling_params)] * len(ids_list)
        rids = [rid] if isinstance(rid, str) else (rid if isinstance(rid, list) else [None] * len(ids_list))
        if (
            (rid is not None and not isinstance(rid, (str, list)))
            or len(rids) != len(ids_list)
            or not all(r is None or isinstance(r, str) for r in rids)
        ):
            raise ParamError("rid", "rid must be a string, or a list of strings with one entry per prompt")
        if any(r and (len(r) > MAX_RID_CHARS or not r.isprintable()) for r in rids):
            raise ParamError("rid", f"a rid is at most {MAX_RID_CHARS} printable characters")
        if isinstance(top_logprobs_num, bool) or not isinstance(top_logprobs_num, int) or top_logprobs_num < 0:
            raise ParamError("top_logprobs_num", f"top_logprobs_num must be an integer >= 0, got {top_logprobs_num!r}")
        if isinstance(logprob_start_len, bool) or not isinstance(logprob_start_len, int):
            raise ParamError("logprob_start_len", f"logprob_start_len must be an integer, got {logprob_start_len!r}")
        check_scheduling(priority, timeout)
        wanted = self.wanted_ids(token_ids_logprob, len(ids_list))
        retention = check_retention(retention_seconds, retention_priority, cache_salt if tenant is None else tenant)
        specs = []
        for ids, p, r, w in zip(ids_list, params, rids, wanted):
            self.validate_prompt(ids, p)
            specs.append(
                RequestSpec(
                    ids,
                    p,
                    r or uuid.uuid4().hex,
                    cache_salt,
                    bool(return_logprob),
                    logprob_start_len,
                    top_logprobs_num,
                    priority,
                    timeout,
                    tenant,
                    self.grammar(p),
                    w if return_logprob else (),
                    retention,
                )
            )
        return specs, single and specs[0].params.n == 1

    def wanted_ids(self, token_ids_logprob: Any, prompts: int) -> list[tuple[int, ...]]:
        """Per prompt, the ids whose logprobs it wants: one list for every prompt, or a list of them per prompt."""
        if token_ids_logprob is None:
            return [()] * prompts
        field = "token_ids_logprob"
        if not isinstance(token_ids_logprob, list):
            raise ParamError(field, "token_ids_logprob must be a list of token ids, or one such list per prompt")
        nested = bool(token_ids_logprob) and isinstance(token_ids_logprob[0], list)
        lists = token_ids_logprob if nested else [token_ids_logprob] * prompts
        if len(lists) != prompts:
            raise ParamError(field, f"token_ids_logprob has {len(lists)} lists for {prompts} prompts")
        for ids in lists:
            if not isinstance(ids, list) or len(ids) > MAX_WANTED_IDS:
                raise ParamError(field, f"each token_ids_logprob list holds at most {MAX_WANTED_IDS} token ids")
            if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size for t in ids):
                raise ParamError(field, f"token_ids_logprob must be token ids in [0, {self.vocab_size})")
        return [tuple(ids) for ids in lists]

    def grammar(self, p: SamplingParams) -> CompiledGrammar | None:
        """The request's compiled grammar (cached: the server compiles it first, see `grammar_jobs`, so the event
        loop only looks it up)."""
        job = self._grammar_job(p)
        return None if job is None else built(job.result())

    def _grammar_job(self, p: SamplingParams) -> Future[CompiledGrammar | ParamError] | None:
        named = p.grammar
        if named is None:
            return None
        if self.grammars is None:
            raise ParamError(named[0], "this engine has no grammar support")
        return self.grammars.submit(*named)

    def compile_grammars(self, sampling_params: Any) -> None:
        """Validate and compile the grammars that sampling_params name, filling the cache (slow the first time a
        schema is seen; the caller's thread waits). Bad params raise ParamError here."""
        for job in self.grammar_jobs(sampling_params):
            built(job.result())

    def grammar_jobs(self, sampling_params: Any) -> list[Future[CompiledGrammar | ParamError]]:
        """Validate sampling_params (ParamError) and submit the grammars they name to the compiler: futures of each
        grammar or its refusal (`grammar.built` raises it), for a caller that waits without holding a thread."""
        given = sampling_params if isinstance(sampling_params, list) else [sampling_params]
        jobs = (self._grammar_job(self.params(g)) for g in given)
        return [job for job in jobs if job is not None]

    def params(self, given: dict[str, Any] | SamplingParams | None) -> SamplingParams:
        """A request's params: the model's defaults under what it sets (a SamplingParams instance sets everything)."""
        if isinstance(given, SamplingParams) or not self.sampling_defaults:
            return SamplingParams.from_dict(given)
        if given is not None and not isinstance(given, dict):
            raise ParamError("sampling_params", f"must be an object, got {type(given).__name__}")
        unset = {k: v for k, v in self.sampling_defaults.items() if (given or {}).get(k) is None}
        return SamplingParams.from_dict({**(given or {}), **unset})

    def encode_prompts(self, prompt: str | list[str]) -> list[list[int]]:
        """Token ids of each prompt, after checking its size: a prompt far longer than the context could ever hold
        is refused before any tokenizing (which costs about a second a megabyte)."""
        texts = [prompt] if isinstance(prompt, str) else prompt
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            raise ParamError("prompt", "prompt must be a string or a list of strings")
        limit = self.max_prompt_chars
        for t in texts:
            if len(t) > limit:
                raise ParamError(
                    "prompt",
                    f"prompt of {len(t)} characters exceeds the limit of {limit} "
                    f"({CHARS_PER_TOKEN} per token of the {self.context_length}-token context)",
                    code="prompt_too_large",
                )
        return [self.tokenizer.encode(t) for t in texts]

    def id_lists(self, input_ids: Any) -> tuple[bool, list[list[int]]]:
        """(single, one id list per prompt) from a list of ids or a list of such lists; ragged nesting refused."""
        if not isinstance(input_ids, list):
            raise ParamError("input_ids", "input_ids must be a list of token ids or a list of such lists")
        single = not input_ids or not isinstance(input_ids[0], list)
        lists = [input_ids] if single else input_ids
        for ids in lists:
            if not isinstance(ids, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in ids):
                raise ParamError("input_ids", "input_ids must be a list of token ids or a list of such lists")
        return single, [list(ids) for ids in lists]

    def validate_prompt(self, ids: list[int], p: SamplingParams) -> None:
        if not ids:
            raise ParamError("prompt", "prompt is empty")
        vocab = self.vocab_size
        if any(t < 0 or t >= vocab for t in ids):
            raise ParamError("prompt", f"token ids must be in [0, {vocab})")
        if any(t >= vocab for t in p.stop_token_ids):
            raise ParamError("stop_token_ids", f"stop_token_ids must be in [0, {vocab})")
        if any(int(t) >= vocab for t in p.logit_bias or {}):
            raise ParamError("logit_bias", f"logit_bias keys must be token ids in [0, {vocab})")
        for limit, fails in (
            (self.context_length, f"exceeds the context length {self.context_length}"),
            (self.pool_tokens, f"cannot fit in the KV pool of {self.pool_tokens} tokens"),
        ):
            if len(ids) > limit:
                raise ParamError("prompt", f"prompt of {len(ids)} tokens {fails}", code="context_length_exceeded")
            if len(ids) + p.max_new_tokens > limit:
                raise ParamError(
                    "max_new_tokens",
                    f"prompt of {len(ids)} tokens + max_new_tokens {p.max_new_tokens} {fails}",
                    code="context_length_exceeded",
                )

    def make_req(self, spec: RequestSpec, stream: bool) -> Req:
        """The scheduler's request for a validated spec (the Engine gives it its output side: OutputStage.open)."""
        p = spec.params
        req = Req(
            rid=spec.rid,
            input_ids=spec.input_ids,
            params=p,
            sampling=SamplingInfo(
                params=p,
                generator=None if p.is_greedy else make_generator(p.seed),
                output_ids=[],
                prompt_ids=spec.input_ids,
                seen=SeenIds(spec.input_ids) if p.repetition_penalty != 1.0 else None,
                top_logprobs_num=spec.top_logprobs_num,
                return_logprob=spec.return_logprob,
                stop_ids=frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else self.eos_ids),
                token_ids_logprob=spec.token_ids_logprob,
            ),
            namespace=spec.cache_salt,
            tenant=spec.cache_salt if spec.tenant is None else spec.tenant,
            retention=spec.retention,
            priority=spec.priority,
            stream=stream,
            return_logprob=spec.return_logprob,
            logprob_start_len=spec.logprob_start_len if spec.return_logprob else -1,
            top_logprobs_num=spec.top_logprobs_num,
        )
        if spec.timeout is not None:
            req.deadline = req.created + spec.timeout
        req.sampling.output_ids = req.output_ids  # the sampler reads penalties from the live list
        if spec.grammar is not None and self.grammars is not None:
            req.grammar = self.grammars.matcher(spec.grammar)
        if req.logprob_start_len >= 0 and req.logprob_start_len < len(spec.input_ids):
            req.next_prompt_logprob_pos = max(req.logprob_start_len, 1)
            if req.logprob_start_len == 0:
                req.input_token_logprobs.append((None, spec.input_ids[0]))
                req.input_top_logprobs.append(None)
        return req


def check_retention(seconds: Any, priority: Any, tenant: str) -> Retention | None:
    """The request's retention (None: plain LRU), or a ParamError naming the field."""
    if seconds is None:
        return None
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds <= MAX_RETENTION_S:
        raise ParamError("retention_seconds", f"retention_seconds must be in (0, {MAX_RETENTION_S:g}], got {seconds!r}")
    if isinstance(priority, bool) or not isinstance(priority, int) or not 1 <= priority <= MAX_PRIORITY:
        raise ParamError("retention_priority", f"retention_priority must be an integer in [1, {MAX_PRIORITY}]")
    return Retention(float(seconds), priority, tenant)


def check_scheduling(priority: Any, timeout: Any) -> None:
    if isinstance(priority, bool) or not isinstance(priority, int) or abs(priority) > 2**31:
        raise ParamError("priority", f"priority must be an integer (higher runs first), got {priority!r}")
    if timeout is not None and (
        isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < 1e9
    ):
        raise ParamError("timeout", f"timeout must be a number of seconds > 0, got {timeout!r}")
