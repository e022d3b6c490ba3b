"""Continuous batching under the target pass's token budget.

Every running request that is past its prompt charges `1 + K` tokens of `max_num_batched_tokens` per
step (its last token plus K draft tokens scored by the target); the draft model runs its own passes and
is not charged here. Decodes are scheduled first; the budget they leave goes to prompt prefill in
chunks, oldest request first, then to admitting waiting requests (FCFS) while a slot is free. Because
the running set is capped at `max_running(...)`, all decodes always fit, and a request being prefilled
always gets at least one decode charge of budget per step: a long prompt neither stalls decodes nor
starves.

The admission arithmetic itself (`max_running`, `capacity`) lives in flyspec/budget.py, torch-free so
that `flyspec capacity` answers at once; it is re-exported here, where the cap is enforced.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from flyspec.budget import Capacity, capacity, max_running

__all__ = ["Capacity", "ScheduledStep", "Scheduler", "capacity", "max_running"]

if TYPE_CHECKING:
    from flyspec.engine.sequence import Sequence


@dataclass
class ScheduledStep:
    """What one engine step runs: decode rows, and prompt chunks as (request, number of tokens)."""

    decodes: list[Sequence] = field(default_factory=list)
    prefills: list[tuple[Sequence, int]] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        """Tokens charged against max_num_batched_tokens (decodes are charged by the scheduler)."""
        return sum(n for _, n in self.prefills)

    @property
    def is_empty(self) -> bool:
        """True when there is nothing to run."""
        return not self.decodes and not self.prefills


class Scheduler:
    """FCFS continuous batching with chunked prefill; owns the waiting queue, running set and slots."""

    def __init__(self, max_num_batched_tokens: int, max_running: int, tokens_per_decode_request: int) -> None:
        self.budget = max_num_batched_tokens
        self.max_running = max_running
        self.charge = tokens_per_decode_request
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # Lowest free slot first, so a lightly loaded engine touches few cache rows.
        self._free_slots = list(range(max_running - 1, -1, -1))

    def add(self, seq: Sequence) -> None:
        """Queue a new request."""
        self.waiting.append(seq)

    def schedule(self) -> ScheduledStep:
        """Pick this step's decodes and prompt chunks within the token budget."""
        step = ScheduledStep(decodes=[s for s in self.running if not s.is_prefilling])
        left = self.budget - len(step.decodes) * self.charge
        for seq in self.running:
            if left <= 0:
                break
            if seq.is_prefilling:
                n = min(left, seq.num_prompt_tokens - seq.num_computed)
                step.prefills.append((seq, n))
                left -= n
        while left > 0 and self.waiting and self._free_slots:
            seq = self.waiting.popleft()
            seq.start(self._free_slots.pop())
            self.running.append(seq)
            n = min(left, seq.num_prompt_tokens)
            step.prefills.append((seq, n))
            left -= n
        return step

    def release_finished(self) -> list[Sequence]:
        """Drop finished requests from the running set, free their slots, and return them."""
        done = [s for s in self.running if s.is_finished]
        if done:
            self.running = [s for s in self.running if not s.is_finished]
            for seq in done:
                self._release(seq)
        return done

    def abort(self, request_id: str) -> Sequence | None:
        """Remove a request wherever it is; return it (None if unknown). Frees its slot."""
        for seq in self.waiting:
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                return seq
        for seq in self.running:
            if seq.request_id == request_id:
                self.running.remove(seq)
                self._release(seq)
                return seq
        return None

    def _release(self, seq: Sequence) -> None:
        if seq.slot is not None:
            self._free_slots.append(seq.slot)
            self._free_slots.sort(reverse=True)
            seq.slot = None

    @property
    def num_running(self) -> int:
        """Requests holding a slot (being prefilled or decoding)."""
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        """Requests queued for a slot."""
        return len(self.waiting)
