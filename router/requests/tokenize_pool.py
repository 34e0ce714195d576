"""A bounded pool for tokenizing large inputs off the event loop, in other processes.

Processes, not threads: the tokenizers library holds the GIL while it encodes (a 1 MB
prompt held it 0.65 s on an idle core here, 5 s on a busy one: `python
bench/router_stall_probe.py`), so a tokenizing thread stalls the router's loop as surely as
tokenizing on it. Each pool process loads the tokenizer once (``source``); a
pool made without one runs its callables on threads (the bounds' unit tests).

Tokenization happens before admission (the admission queue needs token counts to apply the
engine's length rule), so without a bound a flood of huge prompts would pile up in an
executor's unbounded queue, each holding its text and, once encoded, its token list, far
past what the admission bounds allow. Here at most `max_pending` inputs (and at most
`max_chars` characters in all) are being tokenized or waiting for a thread; past either
bound a request is refused at once with RESOURCE_EXHAUSTED (HTTP 429 with Retry-After),
never queued.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import multiprocessing
from collections.abc import Callable
from typing import Any, TypeVar

from router.requests.errors import Overloaded

T = TypeVar("T")
THREADS = 2
MAX_PENDING = 16  # large inputs tokenizing or waiting for a thread
MAX_CHARS = 64 << 20  # characters (or ids) of those inputs, in all


_CHILD_TOKENIZER: Any = None  # a pool process's tokenizer (engine.tokenizer.Tokenizer)


def _load_child(source: str) -> None:
    global _CHILD_TOKENIZER
    from engine.tokenizer import Tokenizer

    _CHILD_TOKENIZER = Tokenizer.from_source(source)


def child_tokenizer() -> Any:
    """The tokenizer of the pool process this runs in."""
    assert _CHILD_TOKENIZER is not None, "not in a tokenize pool process"
    return _CHILD_TOKENIZER


class TokenizePool:
    def __init__(self, threads: int | None = None, max_pending: int | None = None,
                 max_chars: int | None = None, retry_after_s: float = 1.0,
                 source: str | None = None) -> None:
        """source: the model whose tokenizer the pool processes load (None: threads)."""
        threads = THREADS if threads is None else threads
        max_pending = MAX_PENDING if max_pending is None else max_pending
        max_chars = MAX_CHARS if max_chars is None else max_chars
        if threads < 1 or max_pending < 1 or max_chars < 1:
            raise ValueError("threads, max_pending, max_chars: must be >= 1")
        self.max_pending = max_pending
        self.max_chars = max_chars
        self.retry_after_s = retry_after_s
        self.pending = 0
        self.chars = 0
        self.peak_pending = 0  # the most inputs ever held at once (tests, debugging)
        self.peak_chars = 0
        self.refused = 0
        self.source = source
        self._workers = threads
        self._executor: concurrent.futures.Executor | None = None  # made on first use

    @property
    def executor(self) -> concurrent.futures.Executor:
        if self._executor is None:
            if self.source is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    self._workers, thread_name_prefix="tokenize")
            else:  # spawn: forking a process that runs grpc and asyncio is unsafe
                self._executor = concurrent.futures.ProcessPoolExecutor(
                    self._workers, mp_context=multiprocessing.get_context("spawn"),
                    initializer=_load_child, initargs=(self.source,))
        return self._executor

    async def run(self, size: int, fn: Callable[[], T]) -> T:
        """fn() on a pool thread; Overloaded at once if the pool is at a bound."""
        if self.pending >= self.max_pending or self.chars + size > self.max_chars:
            self.refused += 1
            raise Overloaded(f"overloaded: {self.pending} large prompts ({self.chars} "
                             f"characters) are being tokenized, at most {self.max_pending} "
                             f"({self.max_chars} characters); retry after "
                             f"{self.retry_after_s:g} s", self.retry_after_s)
        self.pending += 1
        self.chars += size
        self.peak_pending = max(self.peak_pending, self.pending)
        self.peak_chars = max(self.peak_chars, self.chars)

        def release(_: object) -> None:
            self.pending -= 1
            self.chars -= size

        try:
            fut = asyncio.get_running_loop().run_in_executor(self.executor, fn)
        except BaseException:
            release(None)
            raise
        # the slot is held until the thread is done, even if the client leaves first: its
        # thread is still busy and its text still held
        fut.add_done_callback(release)
        return await asyncio.shield(fut)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
