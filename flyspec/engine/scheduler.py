"""Continuous batching under the target pass's token budget and the KV cache's blocks.

Every running request that is past its prompt charges `1 + K` tokens of `max_num_batched_tokens` per
step (its last token plus K draft tokens scored by the target); the draft model runs its own passes and
is not charged here. Decodes are scheduled first; the budget they leave goes to prompt prefill in
chunks, oldest request first, then to admitting waiting requests (FCFS) while fewer than the cap run.
Because the running set is capped at `max_running(...)`, all decodes always fit, and a request being
prefilled always gets at least one decode charge of budget per step: a long prompt neither stalls decodes
nor starves.

KV blocks (engine/kv_blocks.py). A decode gets blocks for its newest token and K drafts before it runs;
a prompt chunk for its tokens (shortened to the blocks there are). A waiting request is admitted only if
the blocks of its first chunk are there, beyond a reserve of 1% of the cache that running requests grow
into (no reserve when nothing runs); it first shares the registered blocks of its prompt's prefix. When
a decode finds no block, the newest running request is preempted (vLLM's recompute preemption): its
blocks go back, it returns to the head of the queue, and once readmitted (not in the same step) it
computes its tokens again.
Progress is guaranteed: the cache holds at least one request of max_model_len (checked at start), and
the oldest running request may preempt every newer one, so it always runs to its end.

The admission arithmetic itself (`max_running`, `capacity`) lives in flyspec/budget.py, torch-free so
that `flyspec capacity` answers at once; it is re-exported here, where the cap is enforced.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from flyspec.budget import Capacity, capacity, max_running
from flyspec.engine.kv_blocks import BlockManager

__all__ = ["Capacity", "ScheduledStep", "Scheduler", "capacity", "max_running"]

if TYPE_CHECKING:
    from flyspec.engine.sequence import Sequence


@dataclass
class ScheduledStep:
    """What one engine step runs: decode rows, prompt chunks as (request, number of tokens), and the
    requests preempted to make room (back in the waiting queue, holding no blocks)."""

    decodes: list[Sequence] = field(default_factory=list)
    prefills: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        """Tokens charged against max_num_batched_tokens (decodes are charged by the scheduler)."""
        return sum(n for _, n in self.prefills)

    @property
    def is_empty(self) -> bool:
        """True when there is nothing to run."""
        return not self.decodes and not self.prefills


class Scheduler:
    """FCFS continuous batching with chunked prefill; owns the waiting queue, the running set, and which
    KV blocks each running request holds."""

    def __init__(
        self,
        max_num_batched_tokens: int,
        max_running: int,
        tokens_per_decode_request: int,
        blocks: BlockManager,
    ) -> None:
        self.budget = max_num_batched_tokens
        self.max_running = max_running
        self.charge = tokens_per_decode_request
        self.blocks = blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._reserve = max(1, blocks.num_blocks // 100)

    def add(self, seq: Sequence) -> None:
        """Queue a new request."""
        self.waiting.append(seq)

    def schedule(self) -> ScheduledStep:
        """Pick this step's decodes and prompt chunks within the token budget and the free blocks."""
        step = ScheduledStep()
        for seq in list(self.running):
            if seq.is_running and not seq.is_prefilling and self._grow(seq, step):
                step.decodes.append(seq)
        left = self.budget - len(step.decodes) * self.charge
        for seq in list(self.running):
            if left <= 0:
                break
            if not seq.is_running or not seq.is_prefilling:
                continue
            n = self._fit(seq, min(left, seq.num_prefill_tokens - seq.num_computed), step)
            if n:
                step.prefills.append((seq, n))
                left -= n
        # After a preemption nothing is admitted this step: the blocks just freed are for the decodes
        # (readmitting the victim at once would only throw its prefill away again next step).
        computing = self._prefixes_being_computed()
        deferred: list[Sequence] = []
        while left > 0 and self.waiting and len(self.running) < self.max_running and not step.preempted:
            head = self.blocks.first_shareable_hash(self.waiting[0])
            if head is not None and head in computing:
                # Another request is computing this prompt's first block right now (the gate's two arms
                # send each prompt side by side): wait for it, then share its blocks instead of computing
                # the same prefix twice. The waiting request keeps its place in the queue.
                deferred.append(self.waiting.popleft())
                continue
            n = self._admit(self.waiting[0], left)
            if not n:
                break
            seq = self.waiting.popleft()
            seq.start()
            self.running.append(seq)
            step.prefills.append((seq, n))
            left -= n
            if head is not None and self.blocks.registers(seq) and not self.blocks.is_registered(head):
                computing.add(head)
        self.waiting.extendleft(reversed(deferred))
        return step

    def _prefixes_being_computed(self) -> set[bytes]:
        """First-block hashes of running prompts whose first block is not in the cache yet."""
        heads = set()
        for seq in self.running:
            shares = seq.is_prefilling and self.blocks.registers(seq)
            head = self.blocks.first_shareable_hash(seq) if shares else None
            if head is not None and not self.blocks.is_registered(head):
                heads.add(head)
        return heads

    def _grow(self, seq: Sequence, step: ScheduledStep) -> bool:
        """Blocks for a decode (newest token plus K drafts), preempting the newest requests for them;
        False when the request itself was preempted."""
        while not self.blocks.allocate(seq.block_table, seq.num_computed + self.charge):
            victim = self.running[-1]
            self._preempt(victim, step)
            if victim is seq:
                return False
        return True

    def _fit(self, seq: Sequence, n: int, step: ScheduledStep) -> int:
        """Blocks for the next n prompt tokens, or for as many as the free blocks hold; the oldest
        running request preempts newer ones to get at least one block."""
        bs = self.blocks.block_size
        while True:
            room = (len(seq.block_table) + self.blocks.num_free_blocks) * bs - seq.num_computed
            if room > 0 or seq is not self.running[0] or len(self.running) == 1:
                break
            self._preempt(self.running[-1], step)
        n = min(n, room)
        if n > 0:
            assert self.blocks.allocate(seq.block_table, seq.num_computed + n)
        return max(n, 0)

    def _admit(self, seq: Sequence, left: int) -> int:
        """Share the prompt's cached prefix and take the blocks of the first chunk (at most `left`
        tokens); 0 (and nothing held) when they are not there."""
        found = self.blocks.share_prefix(seq)
        seq.num_computed = found
        reserve = self._reserve if self.running else 0
        room = (len(seq.block_table) + self.blocks.num_free_blocks - reserve) * self.blocks.block_size
        n = min(left, seq.num_prefill_tokens - found, room - found)
        if n <= 0 or not self.blocks.allocate(seq.block_table, found + n):
            self.blocks.free_sequence(seq)
            seq.num_computed = 0
            return 0
        self.blocks.count_lookup(seq, found)
        return n

    def _preempt(self, seq: Sequence, step: ScheduledStep) -> None:
        self.running.remove(seq)
        self.blocks.free_sequence(seq)
        seq.preempt()
        self.waiting.appendleft(seq)
        step.preempted.append(seq)
        if seq in step.decodes:
            step.decodes.remove(seq)
        step.prefills = [(s, n) for s, n in step.prefills if s is not seq]

    def release_finished(self) -> list[Sequence]:
        """Drop finished requests from the running set, free their blocks, and return them."""
        done = [s for s in self.running if s.is_finished]
        if done:
            self.running = [s for s in self.running if not s.is_finished]
            for seq in done:
                self.blocks.free_sequence(seq)
        return done

    def abort(self, request_id: str) -> Sequence | None:
        """Remove a request wherever it is; return it (None if unknown). Frees its blocks."""
        for seq in self.waiting:
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                self.blocks.free_sequence(seq)
                return seq
        for seq in self.running:
            if seq.request_id == request_id:
                self.running.remove(seq)
                self.blocks.free_sequence(seq)
                return seq
        return None

    @property
    def num_running(self) -> int:
        """Requests holding KV blocks (being prefilled or decoding)."""
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        """Requests queued for admission (new or preempted)."""
        return len(self.waiting)
