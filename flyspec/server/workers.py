"""Where the handlers' CPU work runs: never on the event loop, in lanes that serve first come, first served.

- **Threads, in two lanes.** Tokenising, rendering chat templates, decoding and building large JSON
  answers run on worker threads, one per lane, each lane a first-come-first-served queue. Work for a
  body over LARGE_BODY_BYTES goes to the heavy lane, everything else to the light one: two 7 MB
  /tokenize calls queue behind each other and hold one core at most, while a small request's
  tokenisation never waits behind them. The light lane is anyio.to_thread with a CapacityLimiter of one
  (anyio wakes a limiter's waiters in arrival order). The heavy lane is a thread of its own, run at the
  lowest CPU priority so that on a busy machine the engine thread and small requests get the cores
  first; a shared pool thread cannot carry a priority (it would keep it for the next job, and raising it
  back needs privileges). The work gives the GIL back often (the Rust tokenizer encodes and decodes
  without it), so the event loop keeps answering meanwhile.
- **A process for large bodies.** json and pydantic hold the GIL for as long as they parse (8 MiB of
  small JSON objects: 0.3-1.6 s), which would stall the event loop from any thread of this process, so
  bodies over LARGE_BODY_BYTES are parsed in a worker process (anyio.to_process, one at a time, at the
  lowest CPU priority as well).
- **A lane and a budget for grammars.** A grammar compiles on its own thread (llguidance releases the
  GIL), one at a time, and must compile within the server's grammar budget, counted from when its
  compile starts; a grammar that does not gets a 400 naming the field. The compile cannot be interrupted
  (llguidance has no cancel), so it runs on to its end holding the lane, which keeps runaway grammars to
  one core: anyio's own timeouts (fail_after with abandon_on_cancel) would free the lane at once and let
  every such request burn a core of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
import anyio.to_process
import anyio.to_thread

_T = TypeVar("_T")

LARGE_BODY_BYTES = 256 << 10
"""Bodies above this are parsed in the worker process and their tokenizer work takes the heavy lane: at
this size pydantic holds the GIL for at most a few tens of milliseconds."""


BACKGROUND_NICENESS = 19
"""CPU priority (Unix niceness) of the heavy lane and the parse process: the lowest."""


def lower_priority() -> None:
    """Give the calling thread the lowest CPU priority (Linux: niceness is per thread); a no-op where the
    system does not allow it."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICENESS)


@dataclass(frozen=True)
class Lane:
    """One FIFO queue of worker-thread work: anyio threads under a limiter of one, or a dedicated
    low-priority thread."""

    name: str
    limiter: anyio.CapacityLimiter | None = None
    executor: ThreadPoolExecutor | None = None

    async def run(self, fn: Callable[[], _T]) -> _T:
        """fn() on this lane's thread, after the work queued before it."""
        if self.executor is not None:
            return await asyncio.wrap_future(self.executor.submit(fn))
        return await anyio.to_thread.run_sync(fn, limiter=self.limiter)


class GrammarTimeout(Exception):
    """A grammar did not compile within the budget."""

    def __init__(self, budget_s: float) -> None:
        super().__init__(budget_s)
        self.budget_s = budget_s


class Workers:
    """The server's worker lanes (see the module docstring)."""

    def __init__(self, grammar_budget_s: float) -> None:
        if not grammar_budget_s > 0:
            raise ValueError(f"grammar_budget_s={grammar_budget_s}: must be > 0")
        self.grammar_budget_s = grammar_budget_s
        self.light = Lane("light", limiter=anyio.CapacityLimiter(1))
        heavy = ThreadPoolExecutor(1, thread_name_prefix="flyspec-heavy", initializer=lower_priority)
        self.heavy = Lane("heavy", executor=heavy)
        self._grammar = anyio.CapacityLimiter(1)
        self._process = anyio.CapacityLimiter(1)

    def lane_for(self, body_bytes: int) -> Lane:
        """The lane for the tokenizer work of a request whose body had this many bytes."""
        return self.heavy if body_bytes > LARGE_BODY_BYTES else self.light

    async def run(self, fn: Callable[[], _T], lane: Lane | None = None) -> _T:
        """fn() on a worker thread of `lane` (the light one by default)."""
        return await (lane or self.light).run(fn)

    def close(self) -> None:
        """Let the heavy lane's thread end once its queue is done."""
        if self.heavy.executor is not None:
            self.heavy.executor.shutdown(wait=False)

    async def run_in_process(self, fn: Callable[..., _T], *args: Any) -> _T:
        """fn(*args) in the worker process; fn and args must pickle (fn a module-level function)."""
        return await anyio.to_process.run_sync(fn, *args, limiter=self._process)

    async def compile_grammar(self, prepare: Callable[[], None], compile_: Callable[[], None]) -> None:
        """Run prepare() (building the grammar tokenizer, once per server) and then compile_() on the
        grammar lane; GrammarTimeout when compile_ has not returned within the budget after it started.
        Exceptions of either propagate."""
        loop = asyncio.get_running_loop()
        started: asyncio.Future[float] = loop.create_future()

        def work() -> None:
            prepare()
            loop.call_soon_threadsafe(_resolve, started, time.monotonic())
            compile_()

        job = asyncio.ensure_future(anyio.to_thread.run_sync(work, limiter=self._grammar))
        job.add_done_callback(_retrieve)  # a job that outlives its request must not log "never retrieved"
        await asyncio.wait({job, started}, return_when=asyncio.FIRST_COMPLETED)
        if not started.done():  # prepare() failed
            job.result()
        remaining = self.grammar_budget_s - (time.monotonic() - started.result())
        done, _ = await asyncio.wait({job}, timeout=max(remaining, 0.0))
        if not done:
            raise GrammarTimeout(self.grammar_budget_s)
        job.result()


def _resolve(future: asyncio.Future[float], value: float) -> None:
    if not future.done():
        future.set_result(value)


def _retrieve(job: asyncio.Future[Any]) -> None:
    if not job.cancelled():
        job.exception()
