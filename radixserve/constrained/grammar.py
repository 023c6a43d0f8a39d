"""Grammars for constrained decoding, through llguidance (https://github.com/guidance-ai/llguidance).

Why llguidance rather than xgrammar (both install without another torch; measured on this repo's default model,
Qwen2.5 vocabulary of 151,936 ids, 2-core Xeon, see benchmarks/RESULTS.md, issue 17): a JSON schema compiles in
~10 ms against xgrammar's ~1.4 s (xgrammar precomputes per-schema token tables; llguidance computes masks lazily
from an Earley parser over a token trie), and a step's mask costs ~0.3 ms per request against ~0.9 ms. Its one-off
cost is the tokenizer trie (~3 s), built in the background when the engine starts.

A request names one grammar: `regex`, `json_schema` (a schema object or its JSON text; `{"type": "object"}` is
OpenAI's `json_object`) or `ebnf` (GBNF, as llama.cpp and xgrammar write it, or llguidance's Lark syntax). Each is
validated once and cached by its text (`GrammarCompiler.compile`), so a schema sent with every request costs one
dict lookup; an invalid one, or one past llguidance's limits (`radixserve/constrained/limits.py`), raises
`ParamError` naming the field, and that refusal is cached too.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from radixserve.constrained.limits import COMPILE_BUDGET_S, Checked, checked_matcher, reason
from radixserve.errors import GrammarFailedError, ParamError
from radixserve.log_bounds import clip
from radixserve.tokenizer import Tokenizer

GRAMMAR_FIELDS = ("regex", "json_schema", "ebnf")
# Compiled grammars kept (LRU), by field and text, refusals included. Each holds a matcher with its lexer's states
# so far (a large grammar's: megabytes), so fewer than the texts alone would allow.
CACHE_SIZE = 128
# JSON as json.dumps writes it by default: the form models produce, and fixed separators leave no whitespace choice,
# so punctuation between values is forced (jump-forward) and a model cannot ramble in blank space until max_tokens.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CONVERT_FAILED = "Failed to convert the grammar from GBNF to Lark: "  # as llguidance's grammar_from words it
EBNF_IN_PROCESS_CHARS = 16_384  # GBNF larger than this is converted to Lark in a child process (_to_lark)
_CONVERT = (
    "import sys\nfrom llguidance.gbnf_to_lark import any_to_lark\nsys.stdout.write(any_to_lark(sys.stdin.read()))"
)


@dataclass(frozen=True, eq=False)
class CompiledGrammar:
    """A validated grammar: the request field that named it and what its check left (limits.Checked: the llguidance
    matcher at its start, its first mask, whether it jumps forward); shared by every request that names it, each of
    which copies the matcher."""

    field: str
    checked: Checked = field(repr=False)


def built(result: CompiledGrammar | ParamError) -> CompiledGrammar:
    """A compile's result, or its refusal raised (a fresh error: raising the cached one would grow its traceback)."""
    if isinstance(result, ParamError):
        raise ParamError(result.field, result.message, result.code)
    return result


class GrammarMatcher:
    """One request's position in its grammar (a copy of the grammar's checked matcher): which tokens may come next,
    and which are forced. `field` is the grammar's request field (regex, json_schema, ebnf), named when it fails.
    `first_mask`: the mask before any token, known from the grammar's check (None once a token is accepted);
    `jump_forward`: whether its forced tokens are cheap enough to compute on the engine loop's thread."""

    def __init__(self, grammar: CompiledGrammar, vocab_size: int) -> None:
        self.ll = grammar.checked.matcher.deep_copy()
        self.vocab_size = vocab_size
        self.field = grammar.field
        self.first_mask: bytes | None = grammar.checked.first_mask
        self.jump_forward = grammar.checked.jump_forward

    def accept(self, token: int) -> bool:
        """Advance by a sampled token; False if the grammar refuses it (the request then fails)."""
        self.first_mask = None
        return self.ll.consume_token(token)

    def forced_tokens(self) -> list[int]:
        """Tokens the grammar allows as the only continuation (jump-forward), not yet accepted."""
        return self.ll.compute_ff_tokens()

    @property
    def error(self) -> str:
        return self.ll.get_error()

    def failure(self, token: int, generated: int) -> GrammarFailedError:
        """Why the request must end: its grammar refused `token` (a limit hit mid-generation, or a bug)."""
        why = reason(self.error) or "no reason given"
        return GrammarFailedError(self.field, f"the {self.field} refused token {token} after {generated} tokens: {why}")

    @property
    def done(self) -> bool:
        """Nothing but end of sequence may follow."""
        return self.ll.is_stopped()


def _canonical_schema(schema: Any) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise ParamError("json_schema", f"json_schema is not valid JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise ParamError("json_schema", "json_schema must be a JSON object (a schema)")
    return json.dumps(schema, sort_keys=True, separators=(",", ":"))


def grammar_text(field: str, source: Any) -> str:
    """The llguidance grammar for a request's grammar field (ParamError where it cannot even be translated)."""
    try:
        if field == "regex":
            return llguidance.LLMatcher.grammar_from_regex(source)
        if field == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(_canonical_schema(source), defaults=JSON_OPTIONS)
        return llguidance.LLMatcher.grammar_from_lark(_to_lark(source))
    except ParamError:
        raise
    except Exception as exc:  # noqa: BLE001 - the library's translation errors are the caller's bad input
        raise ParamError(field, f"invalid {field}: {clip(str(exc))}") from None


def _to_lark(source: str) -> str:
    """GBNF (or Lark) as Lark. llguidance converts GBNF in pure Python: a large grammar would hold the GIL for up to
    half a second in 5 ms slices, and the engine loop's thread, which takes it back after every torch call, would
    slow to a crawl meanwhile; so a large one is converted in a child process (~70 ms to start)."""
    if len(source) <= EBNF_IN_PROCESS_CHARS:
        return _convert(source)
    try:
        done = subprocess.run(
            [sys.executable, "-I", "-c", _CONVERT],
            input=source,
            capture_output=True,
            text=True,
            timeout=COMPILE_BUDGET_S,
        )
    except subprocess.TimeoutExpired:
        raise ParamError(
            "ebnf", f"ebnf took over {COMPILE_BUDGET_S:.1f} s to convert", code="grammar_too_complex"
        ) from None
    if done.returncode != 0:
        why = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit status {done.returncode}"
        raise ValueError(f"{CONVERT_FAILED}{why}")
    return done.stdout


def _convert(source: str) -> str:
    try:
        return any_to_lark(source)
    except Exception as exc:  # noqa: BLE001 - the converter's errors are the caller's bad input
        raise ValueError(f"{CONVERT_FAILED}{exc}") from None


class GrammarCompiler:
    """Validates and caches grammars for one tokenizer and vocabulary; makes per-request matchers.

    The llguidance tokenizer (a trie over the vocabulary) is built on a background thread by the first `compile`,
    which waits for it. Not earlier: building it holds the GIL for 1-2 s with a 150k vocabulary (measured on a busy
    2-core machine), which stalled the model's load at start-up, or the first requests' steps and HTTP handling
    when it ran right after the server began listening; only the first grammar request pays it now.
    Thread-safe. Every grammar is built on the compiler's one worker thread ("radixserve-grammar"), whoever asks:
    never on the engine loop's or an event loop's, and at most one at a time, so a stream of costly grammars takes
    one core at most from the engine (this machine has two)."""

    def __init__(
        self, tokenizer: Tokenizer, vocab_size: int, eos_ids: Sequence[int], budget_s: float = COMPILE_BUDGET_S
    ) -> None:
        self.vocab_size = vocab_size
        self.budget_s = budget_s
        self._cache: OrderedDict[tuple[str, str], CompiledGrammar | ParamError] = OrderedDict()
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="radixserve-grammar")
        self._lock = threading.Lock()
        self._tokenizer: Future[llguidance.LLTokenizer] = Future()
        self._source = tokenizer
        self._eos = sorted(eos_ids)
        self._started = False

    def start(self) -> None:
        """Begin building the llguidance tokenizer on a background thread (once; later calls do nothing)."""
        with self._lock:
            if self._started:
                return
            self._started = True
        threading.Thread(target=self._build_tokenizer, name="radixserve-grammar-init", daemon=True).start()

    def _build_tokenizer(self) -> None:
        try:
            tok = llguidance.LLTokenizer(
                self._source.backend_json(), n_vocab=self.vocab_size, eos_token=self._eos or None
            )
            # The first mask over a vocabulary builds llguidance's caches (seconds for 150k tokens): pay it here.
            warm = llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_regex("[a-z]+"))
            warm.compute_bitmask()
            self._tokenizer.set_result(tok)
        except BaseException as exc:  # noqa: BLE001 - handed to whoever compiles first
            self._tokenizer.set_exception(exc)

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        self.start()
        return self._tokenizer.result()

    def compile(self, field: str, source: Any) -> CompiledGrammar:
        """The validated grammar for `field` (regex, json_schema, ebnf) and its source; cached by its text."""
        return built(self.submit(field, source).result())

    def submit(self, field: str, source: Any) -> Future[CompiledGrammar | ParamError]:
        """The grammar, or its refusal, as a future: done at once when cached, else built on the compiler's thread.
        An event loop awaits it (asyncio.wrap_future) without holding a thread while a costly grammar ahead of it
        builds; a source of the wrong type raises here."""
        if field not in GRAMMAR_FIELDS:
            raise ValueError(f"unknown grammar field {field!r}")
        if not isinstance(source, (str, dict)) or (field != "json_schema" and not isinstance(source, str)):
            raise ParamError(field, f"{field} must be a string")
        key = (field, _canonical_schema(source) if field == "json_schema" else source)
        hit = self._cached(key)
        if hit is None:
            return self._worker.submit(self._build, key, source)
        done: Future[CompiledGrammar | ParamError] = Future()
        done.set_result(hit)
        return done

    def _cached(self, key: tuple[str, str]) -> CompiledGrammar | ParamError | None:
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
            return hit

    def _build(self, key: tuple[str, str], source: Any) -> CompiledGrammar | ParamError:
        """On the worker thread: translate, check against the limits, cache the grammar or its refusal."""
        hit = self._cached(key)  # another caller may have asked for it while this one waited
        if hit is not None:
            return hit
        field = key[0]
        try:
            text = grammar_text(field, source)
            built: CompiledGrammar | ParamError = CompiledGrammar(
                field, checked_matcher(self.ll_tokenizer, text, field, self._eos, self.budget_s)
            )
        except ParamError as exc:
            built = exc
        with self._lock:
            self._cache[key] = built
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return built

    def matcher(self, grammar: CompiledGrammar) -> GrammarMatcher:
        """A request's own matcher: a copy of the grammar's checked one (no compiling, no first mask to compute)."""
        return GrammarMatcher(grammar, self.vocab_size)
