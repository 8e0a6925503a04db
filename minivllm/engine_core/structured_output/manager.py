"""The engine-core's structured outputs: grammars compiled off the busy loop, one matcher per
request, and each step's token bitmask.

    add_request   the request's grammar is looked up in a cache keyed by its `GrammarSpec`;
                  a miss is compiled on a thread pool. The request waits in the scheduler's
                  queue meanwhile, skipped, never holding back the requests behind it.
    poll          (each step) requests whose grammar is done get a matcher, and can be
                  scheduled; one whose grammar failed ends with its error. A continuation's
                  matcher first takes the output it carries.
    accept        (scheduler.update_from_output) a request's new tokens advance its matcher,
                  so the matcher has always taken exactly the output tokens received.
    fill_bitmask  one packed int32 row per constrained request of a step: bit t set = token
                  t allowed (all set once the grammar has ended); with draft tokens, one row
                  per verified position (the matcher steps over the drafts and back).
    validate      (speculative decoding) the prefix of a request's draft tokens that its
                  grammar allows, so that no proposal it refuses is ever verified.

Preemption needs no rollback: a preempted request keeps its output tokens (they are
recomputed, not resampled), and its matcher has taken exactly those.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from minivllm import envs
from minivllm.engine_core.structured_output.grammar import GrammarCompiler, xgrammar
from minivllm.protocol.structured_outputs import GrammarSpec

logger = logging.getLogger(__name__)

# below this many rows one thread fills the bitmask; above, xgrammar's thread pool
_PARALLEL_FILL_ROWS = 16


def _lower_priority() -> None:
    """Lower the calling thread's scheduling priority (Linux: `nice` is per thread)."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)


class StructuredOutputRequest:
    """One request's grammar: a future until compiled, then its matcher."""

    __slots__ = ("spec", "stop_token_ids", "grammar", "matcher", "submitted", "terminated")

    def __init__(self, spec: GrammarSpec, stop_token_ids: list[int]) -> None:
        self.spec = spec
        self.stop_token_ids = stop_token_ids
        self.grammar: Future[Any] | None = None
        self.matcher: Any = None  # None while the grammar compiles
        self.submitted = time.monotonic()
        self.terminated = False  # the grammar has ended (took a stop token)

    @property
    def active(self) -> bool:
        """Whether the next token is constrained (the grammar has not ended)."""
        return not self.terminated

    def validate(self, token_ids: list[int]) -> list[int]:
        """The longest prefix of `token_ids` the grammar allows next; the matcher ends where
        it was."""
        matcher, taken = self.matcher, 0
        terminated = self.terminated
        for token_id in token_ids:
            if terminated:  # past its end the grammar constrains nothing
                break
            if not matcher.accept_token(token_id):
                token_ids = token_ids[:taken]
                break
            taken += 1
            terminated = matcher.is_terminated()
        if taken:
            matcher.rollback(taken)
        return token_ids

    def accept(self, token_ids: list[int]) -> bool:
        """Advance the matcher over `token_ids`; False if the grammar refuses one. Tokens
        after the grammar has ended are not constrained (ignore_eos keeps generating)."""
        matcher = self.matcher
        for token_id in token_ids:
            if self.terminated:
                return True
            if not matcher.accept_token(token_id):
                return False
            self.terminated = matcher.is_terminated()
        return True


class StructuredOutputManager:
    def __init__(
        self, tokenizer: str | None, vocab_size: int, max_num_seqs: int, max_spec_tokens: int = 0
    ) -> None:
        """`tokenizer`: its path (None: the engine has none, structured outputs are refused);
        `max_spec_tokens`: the most draft tokens a request verifies in a step."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_rows = max_num_seqs * (1 + max_spec_tokens)
        self.num_words = -(-vocab_size // 32)
        # two compile threads (one slow grammar leaves the other for the rest), at a lower
        # CPU priority than the busy loop, as are the threads xgrammar starts from them
        self._pool = ThreadPoolExecutor(
            max_workers=2, thread_name_prefix="grammar", initializer=_lower_priority
        )
        self._fill_threads = max(1, min(8, (os.cpu_count() or 1) // 2))
        # built with the first grammar, not at start-up: xgrammar's import brings transformers'
        # and torch's (seconds holding the GIL), which an engine that never sees a structured
        # request should not pay, nor have running beside its first steps
        self._compiler: Future[GrammarCompiler] | None = None
        # compiled grammars, least recently used first out (an 8-field JSON schema's takes
        # ~9 MB at Qwen3's vocabulary, a regex's or a choice's a few KB)
        self._grammars: OrderedDict[GrammarSpec, Future[Any]] = OrderedDict()
        self.cache_bytes = envs.grammar_cache_bytes()
        self.compile_timeout_s = envs.grammar_compile_timeout_s()
        self.waiting: dict[str, tuple[Any, StructuredOutputRequest]] = {}  # compiling
        self._bitmask: np.ndarray | None = None
        self._batch_matcher: Any = None

    # ------------------------------------------------------------------ compiling

    def add_request(self, request: Any, spec: GrammarSpec, stop_token_ids: list[int]) -> None:
        """Give `request` (an engine_core Request) its grammar, compiling it if need be."""
        if self.tokenizer is None:
            raise ValueError(
                "structured_outputs need a tokenizer, but the engine runs with skip_tokenizer_init"
            )
        xgrammar()  # a clear error now if it is not installed
        state = StructuredOutputRequest(spec, stop_token_ids)
        state.grammar = self._grammar(spec)
        request.structured_output = state
        self.waiting[request.request_id] = (request, state)

    def _grammar(self, spec: GrammarSpec) -> Future[Any]:
        future = self._grammars.get(spec)
        if future is not None:
            self._grammars.move_to_end(spec)
            return future
        if self._compiler is None:
            self._compiler = self._pool.submit(GrammarCompiler, self.tokenizer, self.vocab_size)
        future = self._pool.submit(self._compile, self._compiler, spec)
        self._grammars[spec] = future
        self._evict()
        return future

    def _evict(self) -> None:
        """Drop the least recently used compiled grammars past the cache's bytes (requests
        that hold one keep it)."""
        sizes = [
            f.result().memory_size_bytes if f.done() and not f.exception() else 0
            for f in self._grammars.values()
        ]
        total = sum(sizes)
        for spec, size in zip(list(self._grammars), sizes, strict=True):
            if total <= self.cache_bytes:
                return
            if size:  # compiled: still compiling ones take nothing yet
                del self._grammars[spec]
                total -= size

    @staticmethod
    def _compile(compiler: Future[GrammarCompiler], spec: GrammarSpec) -> Any:
        try:
            c = compiler.result()
        except Exception as e:
            raise RuntimeError(f"cannot read the tokenizer's vocabulary: {e}") from e
        return c.compile(spec)

    def poll(self, unfinished: dict[str, Any]) -> list[tuple[str, str]]:
        """Give each waiting request whose grammar is compiled its matcher. Returns
        (request id, error) for each whose grammar failed or took too long; requests that
        ended meanwhile (`unfinished` no longer has them) are forgotten."""
        failed = []
        now = time.monotonic()
        for req_id, (request, state) in list(self.waiting.items()):
            if unfinished.get(req_id) is not request:
                del self.waiting[req_id]
            elif state.grammar.done():
                del self.waiting[req_id]
                try:
                    compiled = state.grammar.result()
                    state.matcher = self._compiler.result().matcher(compiled, state.stop_token_ids)
                except Exception as e:
                    self._grammars.pop(state.spec, None)  # a later request may try again
                    failed.append((req_id, f"structured_outputs: {e}"))
                    continue
                if not state.accept(request.output_token_ids):
                    refused = "the grammar refuses the output_token_ids of this continuation"
                    failed.append((req_id, f"structured_outputs: {refused}"))
            elif now - state.submitted > self.compile_timeout_s:
                del self.waiting[req_id]
                late = f"the grammar did not compile within {self.compile_timeout_s:.0f} s"
                failed.append((req_id, f"structured_outputs: {late}"))
        return failed

    def wait(self, timeout: float) -> None:
        """Block until a waiting request's grammar is compiled, or `timeout` seconds."""
        futures = [state.grammar for _, state in self.waiting.values()]
        if futures:
            concurrent.futures.wait(futures, timeout, concurrent.futures.FIRST_COMPLETED)

    # ------------------------------------------------------------------ bitmask

    def fill_bitmask(
        self, requests: list[Any], drafts: list[list[int]] | None = None
    ) -> np.ndarray:
        """The token bitmask rows of `requests` (engine_core Requests, or None for one that
        ended since its step was scheduled: any token, the step's sample is dropped): one
        per request, or with `drafts` (each request's draft tokens) 1 + len(drafts) per
        request, row j the mask after its first j drafts."""
        xgr = xgrammar()
        if self._bitmask is None:
            self._bitmask = np.empty((self.max_rows, self.num_words), dtype=np.int32)
            self._batch_matcher = xgr.BatchGrammarMatcher(max_threads=self._fill_threads)
        counts = [1] * len(requests) if drafts is None else [1 + len(d) for d in drafts]
        bitmask = self._bitmask[: sum(counts)]
        matchers, rows = [], []
        row = 0
        for i, request in enumerate(requests):
            state = None if request is None else request.structured_output
            if state is None or state.terminated:
                bitmask[row : row + counts[i]] = -1
            elif counts[i] > 1:
                _fill_over_drafts(state, drafts[i], bitmask, row)
            else:
                matchers.append(state.matcher)
                rows.append(row)
            row += counts[i]
        if len(matchers) >= _PARALLEL_FILL_ROWS:
            self._batch_matcher.batch_fill_next_token_bitmask(matchers, bitmask, rows)
        else:
            for matcher, i in zip(matchers, rows, strict=True):
                matcher.fill_next_token_bitmask(bitmask, i)
        return bitmask

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _fill_over_drafts(
    state: StructuredOutputRequest, drafts: list[int], bitmask: np.ndarray, row: int
) -> None:
    """Rows row..row+len(drafts) of `bitmask`: the masks before each draft and after the
    last (all set past the grammar's end); the matcher is stepped over the drafts (which
    `validate` let through) and back."""
    matcher, taken = state.matcher, 0
    for j in range(len(drafts) + 1):
        if matcher.is_terminated():
            bitmask[row + j : row + len(drafts) + 1] = -1
            break
        matcher.fill_next_token_bitmask(bitmask, row + j)
        if j < len(drafts):
            if not matcher.accept_token(drafts[j]):
                raise RuntimeError(f"draft token {drafts[j]} refused by its grammar")
            taken += 1
    if taken:
        matcher.rollback(taken)
