"""Structured outputs: each constraint compiled once (llguidance, cached), one matcher per request, and the token
bitmask each step applies to those requests' logits rows before sampling.

Compiling is the only costly part (up to ~1 s for a large schema): the replica compiles at its edge, in a thread,
before the request reaches the step loop, so `add_request` finds the grammar cached and only copies a matcher.
The masks of a step are computed on a background thread while the forward pass runs (llguidance releases the GIL
and spreads a batch over its own threads), so a step waits only for the part that did not overlap.

Speculative drafts are not proposed for structured requests (spec_decode.py): a draft the grammar forbids would
be verified against a target distribution that the mask changes position by position, so they decode one token
per step, exactly as without a speculator.
"""

from __future__ import annotations

import itertools
import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ember_platform.engine.sampling_params import StructuredOutput

if TYPE_CHECKING:
    import llguidance

    from ember_platform.engine.request import Request
    from ember_platform.engine.text.tokenizer import Tokenizer

DEFAULT_GRAMMAR_CACHE_SIZE = 256  # compiled grammars kept (a tool list or a schema is one entry)
# JSON as `json.dumps` writes it, with no free whitespace: a model cannot pad the output with blanks until it runs
# out of tokens (vLLM's "disable_any_whitespace"). A schema may still ask for more in its "x-guidance" options.
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_BITS = 32  # a mask word covers 32 token ids


class StructuredOutputError(ValueError):
    """A constraint the grammar engine cannot honor (an unsupported keyword, an invalid regex, a bad grammar)."""

    def __init__(self, structured: StructuredOutput, reason: str) -> None:
        super().__init__(f"{structured.kind} cannot be used: {reason}")
        self.kind = structured.kind
        self.reason = reason


def grammar_source(structured: StructuredOutput) -> str:
    """The llguidance grammar (its JSON form) that accepts exactly the outputs `structured` allows."""
    import llguidance

    matcher = llguidance.LLMatcher
    kind, spec = structured.kind, structured.spec
    if kind == "json_schema" and spec.strip() in ("true", "false"):  # a boolean schema: anything, or nothing
        if spec.strip() == "false":
            raise ValueError("the schema false accepts no value")
        spec = "{}"
    if kind == "json_schema":
        return matcher.grammar_from_json_schema(spec, defaults=JSON_OPTIONS)
    if kind == "json_object":
        return matcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_OPTIONS)
    if kind == "regex":
        return matcher.grammar_from_regex(spec)
    if kind == "choice":
        # Lark string literals take JSON's escapes, so json.dumps quotes any choice exactly.
        return matcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in json.loads(spec)))
    return matcher.grammar_from_lark(spec)


def clean_error(kind: str, message: str) -> str:
    """llguidance's error on one line: source excerpts and caret lines dropped; for a regex or a schema also the
    position in the wrapper grammar Ember built around it (meaningless to the client)."""
    lines = [line.strip() for line in message.splitlines()]
    kept = [line for line in lines if line and not re.fullmatch(r"\^+", line) and not re.match(r"\d+ \|", line)]
    text = " ".join(kept)
    if kind != "grammar":
        text = re.sub(r"^at \d+\(\d+\): ", "", text)
        text = text.replace(" (in regex)", "")
    return text


class GrammarCompiler:
    """Compiles constraints against one tokenizer, once each (an LRU cache keyed by the StructuredOutput).

    Thread-safe: the replica compiles in worker threads while the step loop copies matchers out of the cache.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, *, cache_size: int = DEFAULT_GRAMMAR_CACHE_SIZE,
                 limits: llguidance.LLParserLimits | None = None) -> None:
        self._tokenizer = tokenizer
        self.limits = limits  # llguidance's parser limits (None: its defaults)
        # The model's vocabulary may be padded past the tokenizer's (embedding rows no token maps to): masks cover
        # every logits column, and llguidance never allows the padding ids.
        self.vocab_size = max(vocab_size, tokenizer.vocab_size)
        self.cache_size = cache_size
        self._lock = threading.Lock()
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[StructuredOutput, llguidance.LLMatcher] = OrderedDict()
        self._compiling: dict[StructuredOutput, Future[llguidance.LLMatcher]] = {}  # being compiled now
        self.num_compiled = 0
        self.num_cache_hits = 0

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the tokenizer, built from its tokenizer.json on first use (~10 ms per 4k tokens)."""
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance

                self._ll_tokenizer = llguidance.LLTokenizer(
                    self._tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                    eos_token=sorted(self._tokenizer.eos_token_ids) or None)
            return self._ll_tokenizer

    def is_cached(self, structured: StructuredOutput) -> bool:
        with self._lock:
            return structured in self._cache

    def compile(self, structured: StructuredOutput) -> llguidance.LLMatcher:
        """The compiled grammar of `structured` (a pristine matcher: copy it, never advance it).

        Requests that bring the same constraint at once share one compile: the first compiles, the others wait
        for it (and count as cache hits). Raises StructuredOutputError with llguidance's reason when it cannot be
        honored.
        """
        with self._lock:
            cached = self._cache.get(structured)
            if cached is not None:
                self._cache.move_to_end(structured)
                self.num_cache_hits += 1
                return cached
            pending = self._compiling.get(structured)
            if pending is not None:
                self.num_cache_hits += 1
            else:
                self._compiling[structured] = compiling = Future()
        if pending is not None:
            return pending.result()  # the first request's matcher, or its error
        try:
            matcher = self._build(structured)
        except BaseException as e:
            compiling.set_exception(e)
            raise
        finally:
            with self._lock:
                self._compiling.pop(structured, None)
        compiling.set_result(matcher)
        return matcher

    def _build(self, structured: StructuredOutput) -> llguidance.LLMatcher:
        import llguidance

        tokenizer = self.ll_tokenizer
        try:
            source = grammar_source(structured)
        except ValueError as e:  # the schema is not JSON llguidance can read
            raise StructuredOutputError(structured, clean_error(structured.kind, str(e))) from None
        # Building the lexer and parser happens here, with the GIL released (the replica runs this in a thread).
        matcher = llguidance.LLMatcher(tokenizer, source, log_level=0, limits=self.limits)
        if matcher.is_error():
            raise StructuredOutputError(structured, clean_error(structured.kind, matcher.get_error()))
        with self._lock:
            self.num_compiled += 1
            self._cache[structured] = matcher
            self._cache.move_to_end(structured)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return matcher

    def new_matcher(self, structured: StructuredOutput) -> llguidance.LLMatcher:
        """A fresh matcher for one request (compiled now only if the edge did not compile it already)."""
        template = self.compile(structured)
        with self._lock:  # the template is shared with other threads copying it
            return template.deep_copy()


@dataclass(slots=True)
class PendingMasks:
    """One step's masks, being computed: `rows[i]` is the index, among the step's sampled requests, of mask row i."""

    rows: list[int]
    request_ids: list[str]  # of each mask row
    bitmask: torch.Tensor  # [len(rows), words] int32, bit t of row i = token t allowed
    done: Future[None] | None  # None: computed already
    errors: dict[str, str] = field(default_factory=dict)  # request id -> why its matcher failed (see `apply`)


class StructuredRequests:
    """The matchers of an engine's structured requests; computes and applies their token masks each step."""

    def __init__(self, compiler: GrammarCompiler, *, num_threads: int | None = None) -> None:
        self.compiler = compiler
        self.vocab_size = compiler.vocab_size
        self.num_words = -(-self.vocab_size // _BITS)
        self._matchers: dict[str, llguidance.LLMatcher] = {}
        self._num_threads = num_threads
        self._executor: llguidance.LLExecutor | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._shifts: dict[torch.device, torch.Tensor] = {}
        self.num_masked_rows = 0  # logits rows a grammar mask was applied to (a test sees the engine use them)
        self.mask_seconds = 0.0  # computing masks, on the background thread
        self.mask_wait_seconds = 0.0  # the step waiting for them after its forward pass (what overlap did not hide)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def __len__(self) -> int:
        return len(self._matchers)

    def add(self, request_id: str, structured: StructuredOutput) -> None:
        self._matchers[request_id] = self.compiler.new_matcher(structured)

    def release(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def start_masks(self, sampled: Sequence[Request]) -> PendingMasks | None:
        """Begin computing the masks of this step's structured requests (in `sampled`, the requests the step
        samples), on a background thread: call before the forward pass, collect with `apply`."""
        rows = [i for i, req in enumerate(sampled) if req.request_id in self._matchers]
        if not rows:
            return None
        import llguidance

        if self._executor is None:
            self._executor = llguidance.LLExecutor(self._num_threads)
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="ember-grammar")
        bitmask = torch.empty((len(rows), self.num_words), dtype=torch.int32)
        request_ids = [sampled[i].request_id for i in rows]
        jobs = [(self._matchers[request_id], k) for k, request_id in enumerate(request_ids)]
        executor, num_words = self._executor, self.num_words

        def fill() -> None:  # holds `bitmask` alive while llguidance writes through its pointer
            t0 = time.perf_counter()
            executor.unsafe_compute_mask_ptr(jobs, bitmask.data_ptr(), num_words * 4, bitmask.shape[0])
            self.mask_seconds += time.perf_counter() - t0

        assert self._pool is not None
        return PendingMasks(rows, request_ids, bitmask, self._pool.submit(fill))

    def apply(self, pending: PendingMasks | None, logits: torch.Tensor,
              num_rows: Sequence[int]) -> torch.Tensor:
        """`logits` [N, V] with each structured request's disallowed tokens at -inf (a new tensor; the executor's
        is left as it was). `num_rows[i]`: the logits rows of sampled request i (1, or 1 + its drafts).

        A matcher that failed computing its mask (a grammar past llguidance's limits) allows nothing: its row is
        left unmasked, so that sampling does not divide by zero, and `pending.errors` says why, for the engine to
        fail that request alone."""
        if pending is None:
            return logits
        if pending.done is not None:
            t0 = time.perf_counter()
            pending.done.result()
            self.mask_wait_seconds += time.perf_counter() - t0
            pending.done = None
            for k, request_id in enumerate(pending.request_ids):
                matcher = self._matchers.get(request_id)
                if matcher is not None and matcher.is_error():
                    # Its first line: the rest is parser state (and may quote the grammar).
                    pending.errors[request_id] = (matcher.get_error() or "the grammar failed").splitlines()[0]
                    pending.bitmask[k].fill_(-1)
        starts = list(itertools.accumulate(num_rows, initial=0))
        index = torch.tensor([starts[i] for i in pending.rows], dtype=torch.long, device=logits.device)
        allowed = self._unpack(pending.bitmask.to(logits.device, non_blocking=True), logits.shape[-1])
        masked = logits.clone()
        # Logprobs are then those of the constrained distribution, as vLLM reports them under a grammar.
        masked[index] = logits.index_select(0, index).masked_fill(~allowed, float("-inf"))
        self.num_masked_rows += len(pending.rows)
        return masked

    def _unpack(self, bitmask: torch.Tensor, width: int) -> torch.Tensor:
        # bitmask: [R, W] int32 -> [R, width] bool; bit b of word w is token 32 w + b
        shifts = self._shifts.get(bitmask.device)
        if shifts is None:
            shifts = self._shifts[bitmask.device] = torch.arange(_BITS, dtype=torch.int32, device=bitmask.device)
        bits = (bitmask.unsqueeze(-1) >> shifts) & 1
        return bits.view(bitmask.shape[0], -1)[:, :width].bool()

    def accept(self, request_id: str, token_id: int) -> bool:
        """Advance the request's matcher past its sampled token; True once its grammar is complete (nothing but
        EOS may follow), so the request stops. Raises if the grammar refuses the token (a broken mask)."""
        matcher = self._matchers[request_id]
        if not matcher.consume_token(token_id):
            raise RuntimeError(f"the grammar refused token {token_id}: {matcher.get_error() or 'not allowed'}")
        return matcher.is_stopped()

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
