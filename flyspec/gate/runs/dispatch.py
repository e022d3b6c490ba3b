"""Run every executor of a session at once and hand their answers to the main thread through one queue.

Engines (``in_turns``) take turns answer by answer on one background thread, so each one's busy time is its
own; endpoints (``concurrently``) share one asyncio loop on another. The main thread grades, stores and
monitors every answer (signal-based grader timeouts and the one SQLite connection stay there). ``stop``
starts no new job (what is in flight still arrives); ``abort`` gives up on it (Ctrl-C). An endpoint may
not start a question more than ``window`` positions ahead of the slowest other arm, so an interrupted run
holds complete pairs.
"""

from __future__ import annotations

import asyncio
import math
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from flyspec.gate.arms.base import Completion, ConcurrentExecutor, Executor, Job, Sampling, TurnExecutor


@dataclass(frozen=True)
class Answer:
    """One finished job, from executor number ``executor``."""

    executor: int
    job: Job
    completion: Completion


@dataclass
class ExecutorTime:
    """How long an executor was busy in this session (engine: inside its steps; endpoint: wall time from
    its first request to its last answer) and what it produced."""

    seconds: float = 0.0
    answers: int = 0
    completion_tokens: int = 0


@dataclass
class Feed:
    """The jobs of one executor, in the run's order, handed out one at a time."""

    jobs: list[Job]
    index: int = 0
    unfinished: dict[int, int] = field(default_factory=dict)

    def frontier(self) -> float:
        """The earliest position this executor has not finished (inf when it has nothing left)."""
        if self.unfinished:
            return min(self.unfinished)
        return self.jobs[self.index].position if self.index < len(self.jobs) else math.inf


class Dispatcher:
    """Drives the executors over their jobs; ``next`` hands the answers to the caller's thread.

    Use as a context manager: leaving it stops the feeds and, on an exception, aborts what is in flight.
    """

    def __init__(self, executors: list[Executor], jobs: list[list[Job]], sampling: Sampling) -> None:
        self.executors = executors
        self.sampling = sampling
        self.feeds = [Feed(list(j)) for j in jobs]
        self.times = [ExecutorTime() for _ in executors]
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._aborted = threading.Event()
        self._queue: queue.Queue[Answer | tuple[str, int, BaseException | None]] = queue.Queue()
        self._running = 0
        self._errors: list[BaseException] = []
        self._threads: list[threading.Thread] = []

    # ------------------------------------------------------------------------------------ control

    def stop(self) -> None:
        """Start no new job; what is in flight finishes and is still delivered."""
        self._stopped.set()

    def abort(self) -> None:
        """Stop and give up on the requests in flight (their answers are lost; nothing stored is)."""
        self._stopped.set()
        self._aborted.set()

    def drop(self, keep: Callable[[Job], bool]) -> None:
        """Drop the jobs for which ``keep`` is false: those not yet started, and those in flight on an
        executor that can cancel them (an engine; an endpoint's requests finish and are delivered). A
        comparison that stopped needs no more answers from its candidate, and the slots go to the others."""
        with self._lock:
            for feed in self.feeds:
                feed.jobs = feed.jobs[: feed.index] + [j for j in feed.jobs[feed.index :] if keep(j)]
        for index, executor in enumerate(self.executors):
            cancel = getattr(executor, "cancel", None)
            if cancel is None:
                continue
            for job in cancel(lambda j: not keep(j)):
                self._release(index, job)

    @property
    def failed(self) -> bool:
        """True once an executor raised (the error is raised by ``raise_error``)."""
        return bool(self._errors)

    @property
    def finished(self) -> bool:
        """True once every executor has delivered its last answer."""
        return self._running == 0 and self._queue.empty()

    def next(self, timeout: float) -> Answer | None:
        """The next answer, or None after ``timeout`` seconds without one (or once finished)."""
        while True:
            try:
                item = self._queue.get(timeout=timeout)
            except queue.Empty:
                return None
            if isinstance(item, Answer):
                spent = self.times[item.executor]
                spent.answers += 1
                spent.completion_tokens += item.completion.completion_tokens
                return item
            _, index, error = item
            if error is not None:
                self._errors.append(error)
                self.stop()
            else:
                self._running -= 1
            if self.finished:
                return None

    def raise_error(self) -> None:
        """Raise the first executor error, if any (call once ``finished``)."""
        if self._errors:
            raise self._errors[0]

    def __enter__(self) -> Dispatcher:
        """Start the background threads (one per way of driving that some executor asks for)."""
        drivers = {"in_turns": self._drive_in_turns, "concurrently": self._drive_concurrently}
        unknown = {ex.drive for ex in self.executors} - set(drivers)
        if unknown:
            raise ValueError(f"executor drive {sorted(unknown)}: must be one of {', '.join(drivers)}")
        self._running = len(self.executors)
        for drive, target in drivers.items():
            members = [i for i, ex in enumerate(self.executors) if ex.drive == drive]
            if members:
                # Daemon: after Ctrl-C the process may exit while a step is still running.
                thread = threading.Thread(target=target, args=(members,), daemon=True)
                thread.start()
                self._threads.append(thread)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is not None:
            self.abort()
        self.stop()
        for thread in self._threads:
            # After an abort, do not wait for a request still waiting on its server or an engine step
            # still running (the threads are daemons): Ctrl-C must stop the run within 2 seconds.
            thread.join(timeout=0.2 if self._aborted.is_set() else None)

    # ------------------------------------------------------------------------------------- feeding

    def _take(self, index: int, *, paced: bool) -> Job | None | bool:
        """The next job of feed ``index``; None when there is none; False when it must wait its turn."""
        with self._lock:
            feed = self.feeds[index]
            if self._stopped.is_set() or feed.index >= len(feed.jobs):
                return None
            job = feed.jobs[feed.index]
            if paced:
                others = [f.frontier() for i, f in enumerate(self.feeds) if i != index]
                window = 2 * self.executors[index].max_in_flight
                if others and job.position >= min(others) + window:
                    return False
            feed.index += 1
            feed.unfinished[job.position] = feed.unfinished.get(job.position, 0) + 1
            return job

    def _finished(self, index: int, answer: Answer) -> None:
        self._release(index, answer.job)
        self._queue.put(answer)

    def _release(self, index: int, job: Job) -> None:
        """Job ``job`` of feed ``index`` is no longer in flight (answered or cancelled)."""
        with self._lock:
            unfinished = self.feeds[index].unfinished
            unfinished[job.position] -= 1
            if not unfinished[job.position]:
                del unfinished[job.position]

    def _jobs(self, index: int) -> Iterator[Job]:
        while isinstance(job := self._take(index, paced=False), Job):
            yield job

    def _drive_in_turns(self, members: list[int]) -> None:
        executors: dict[int, TurnExecutor] = {i: self.executors[i] for i in members}  # type: ignore[misc]
        streams = {i: ex.answers(self._jobs(i), self.sampling) for i, ex in executors.items()}
        while streams:
            for i in list(streams):
                if self._aborted.is_set():
                    for stream in streams.values():
                        stream.close()  # aborts the requests in flight
                    for j in streams:
                        self._queue.put(("done", j, None))
                    return
                started = time.perf_counter()
                try:
                    job, completion = next(streams[i])
                except StopIteration:
                    del streams[i]
                    self._queue.put(("done", i, None))
                    continue
                except Exception as exc:  # handed to the main thread, which stops the other arms
                    del streams[i]
                    self._queue.put(("error", i, exc))
                    self._queue.put(("done", i, None))
                    continue
                finally:
                    self.times[i].seconds += time.perf_counter() - started
                self._finished(i, Answer(i, job, completion))

    def _drive_concurrently(self, members: list[int]) -> None:
        async def one(i: int) -> None:
            executor: ConcurrentExecutor = self.executors[i]  # type: ignore[assignment]

            async def next_job() -> Job | None:
                while (job := self._take(i, paced=True)) is False:
                    await asyncio.sleep(0.01)
                return job  # type: ignore[return-value]

            started = time.perf_counter()
            try:
                await executor.serve(next_job, self.sampling, lambda j, c: self._finished(i, Answer(i, j, c)))
            except Exception as exc:  # handed to the main thread, which stops the other arms
                self._queue.put(("error", i, exc))
            finally:
                self.times[i].seconds += time.perf_counter() - started
                self._queue.put(("done", i, None))

        async def every_one() -> None:
            await asyncio.gather(*(one(i) for i in members))

        asyncio.run(every_one())
