"""Token-budget admission (flyspec/budget.py): max_running arithmetic and the scheduler's batching decisions.

The engine-level behaviour under saturating load (cap reached, never exceeded, decode continuing during a
chunked prefill) is in tests/test_engine.py; here the scheduler runs on real Sequence objects whose
prefill progress is advanced the way the engine advances it.
"""

from __future__ import annotations

import pytest

from flyspec.engine.kv_blocks import BlockManager
from flyspec.engine.scheduler import Scheduler, capacity, max_running
from flyspec.engine.sequence import Sequence
from flyspec.sampling_params import SamplingParams


@pytest.mark.parametrize(
    ("budget", "seqs", "charge", "lookahead", "expected", "binding"),
    [
        (512, 64, 10, None, 51, "budget"),
        (512, 128, 10, None, 51, "budget"),
        (512, 64, 6, None, 64, "max_num_seqs"),
        (512, 128, 6, None, 85, "budget"),
        (512, 128, 6, 5, 85, "budget"),  # 512 // 5 = 102 does not bind here
        (512, 128, 2, 5, 102, "lookahead"),  # ... but does when the charge is small
        (512, 64, 8, None, 64, "max_num_seqs"),  # a tie is reported as max_num_seqs
        (6, 1, 6, None, 1, "max_num_seqs"),
    ],
)
def test_max_running_on_the_published_examples(budget, seqs, charge, lookahead, expected, binding) -> None:
    """max_running = min(S, B // charge[, B // L]) with the binding limit named (the published examples)."""
    assert max_running(budget, seqs, charge, lookahead) == expected
    cap = capacity(budget, seqs, charge, lookahead)
    assert (cap.max_running, cap.binding, cap.tokens_per_decode_request) == (expected, binding, charge)


def test_log_line_names_charge_cap_and_binding_limit() -> None:
    """The start-up line has the documented wording and says which limit binds."""
    line = capacity(512, 128, 6).describe()
    assert line.startswith(
        "each decode request charges 6 tokens of max_num_batched_tokens=512: at most 85 of "
        "max_num_seqs=128 requests can run"
    )
    assert "token budget binds" in line
    assert "max_num_seqs binds" in capacity(512, 64, 6).describe()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((0, 16, 1), "max_num_batched_tokens=0"),
        ((-5, 16, 1), "max_num_batched_tokens=-5"),
        ((512, 0, 1), "max_num_seqs=0"),
        ((512, 16, 0), "tokens_per_decode_request=0"),
        ((5, 16, 6), "raise max_num_batched_tokens to at least 6"),
    ],
)
def test_bad_budgets_raise_saying_what_to_raise(args, message) -> None:
    """Non-positive values and a budget below one request's charge are ValueErrors naming the fix."""
    with pytest.raises(ValueError, match=message):
        capacity(*args)


def _seq(i: int, prompt_len: int) -> Sequence:
    return Sequence(f"r{i}", None, list(range(1, prompt_len + 1)), SamplingParams(), i, frozenset())


def _advance(step) -> None:
    """What the engine does after a step: prefill chunks enter the cache, finished prompts get a token
    (a preempted request computing its tokens again gets none: its next token is known)."""
    for seq, n in step.prefills:
        seq.num_computed += n
        if not seq.is_prefilling and not seq.output_token_ids:
            seq.output_token_ids.append(7)
    for seq in step.decodes:
        seq.output_token_ids.append(7)
        seq.num_computed = seq.num_tokens - 1


def test_admission_fills_the_cap_and_never_exceeds_it() -> None:
    """With 20 waiting requests and a cap of 4, exactly 4 run; finishing one admits the next (FCFS)."""
    sched = Scheduler(24, max_running=4, tokens_per_decode_request=6, blocks=BlockManager(64, 16))
    seqs = [_seq(i, 3) for i in range(20)]
    for s in seqs:
        sched.add(s)
    for _ in range(5):
        step = sched.schedule()
        assert sched.num_running == 4
        assert len(step.decodes) * 6 + step.num_batched_tokens <= 24
        _advance(step)
    assert [s.request_id for s in sched.running] == ["r0", "r1", "r2", "r3"]
    assert [s.block_table for s in sched.running] == [[0], [1], [2], [3]]
    seqs[1].finish("stop")
    assert sched.release_finished() == [seqs[1]] and seqs[1].block_table == []
    step = sched.schedule()
    assert [s.request_id for s, _ in step.prefills] == ["r4"]
    assert seqs[4].block_table == [1]  # the freed block is reused
    assert sched.num_running == 4 and sched.num_waiting == 15


def test_long_prompt_is_chunked_while_decodes_continue() -> None:
    """A 100-token prompt is prefilled with the budget the decodes leave, in several steps, and every
    running request decodes in every one of those steps."""
    sched = Scheduler(32, max_running=5, tokens_per_decode_request=6, blocks=BlockManager(64, 16))
    short = [_seq(i, 2) for i in range(3)]
    for s in short:
        sched.add(s)
    _advance(sched.schedule())  # the three short prompts are prefilled in one step
    long = _seq(9, 100)
    sched.add(long)
    chunks = []
    while long.is_prefilling:
        step = sched.schedule()
        assert {s.request_id for s in step.decodes} == {"r0", "r1", "r2"}
        assert len(step.prefills) == 1 and step.prefills[0][0] is long
        chunks.append(step.prefills[0][1])
        assert 3 * 6 + step.num_batched_tokens <= 32
        _advance(step)
    assert chunks == [14] * 7 + [2]
    assert long in sched.schedule().decodes


def test_abort_frees_the_blocks_of_a_running_request_and_drops_a_waiting_one() -> None:
    """abort() removes a request wherever it is and its blocks go back to the pool."""
    blocks = BlockManager(4, 16)
    sched = Scheduler(8, max_running=1, tokens_per_decode_request=2, blocks=blocks)
    a, b = _seq(0, 3), _seq(1, 3)
    sched.add(a)
    sched.add(b)
    sched.schedule()
    assert a.block_table == [0] and blocks.num_used_blocks == 1
    assert sched.abort("r1") is b and sched.num_waiting == 0
    assert sched.abort("r0") is a and a.block_table == [] and sched.num_running == 0
    assert blocks.num_used_blocks == 0
    assert sched.abort("missing") is None
    c = _seq(2, 3)
    sched.add(c)
    sched.schedule()
    assert c.block_table == [0]


def test_admission_waits_for_blocks_and_decodes_always_have_theirs() -> None:
    """With 10 blocks of 4 positions and 10-token prompts, requests are admitted only while their first
    chunk's blocks (plus a one-block reserve for growth) are free; every scheduled decode holds blocks for
    its newest token and K drafts; nothing is ever admitted beyond the cache."""
    blocks = BlockManager(10, 4)
    sched = Scheduler(64, max_running=8, tokens_per_decode_request=3, blocks=blocks)
    for i in range(6):
        sched.add(_seq(i, 10))
    step = sched.schedule()
    assert [s.request_id for s, _ in step.prefills] == ["r0", "r1", "r2"] and sched.num_waiting == 3
    for _ in range(6):
        _advance(step)
        step = sched.schedule()
        for seq in step.decodes:
            assert len(seq.block_table) * 4 >= seq.num_computed + 3
        assert blocks.num_used_blocks <= 10


def test_a_decode_without_blocks_preempts_the_newest_request_which_recomputes_later() -> None:
    """When a decode finds no free block, the newest running request gives its blocks back, returns to
    the head of the queue with its generated tokens, and once readmitted prefills every token but its
    newest before it decodes again."""
    blocks = BlockManager(6, 4)
    sched = Scheduler(64, max_running=4, tokens_per_decode_request=2, blocks=blocks)
    old, new = _seq(0, 8), _seq(1, 8)
    sched.add(old)
    sched.add(new)
    preempted = []
    for _ in range(12):
        step = sched.schedule()
        preempted += step.preempted
        _advance(step)
        if preempted:
            break
    assert preempted == [new] and list(sched.waiting) == [new]
    assert new.block_table == [] and new.num_computed == 0 and new.output_token_ids
    old.finish("stop")
    sched.release_finished()
    step = sched.schedule()
    assert step.prefills == [(new, new.num_tokens - 1)]
    _advance(step)
    assert not new.is_prefilling and new in sched.schedule().decodes


@pytest.mark.parametrize("seed", range(5))
def test_random_load_on_a_small_cache_always_finishes(seed: int) -> None:
    """A seeded random workload (prompts of 1-40 tokens, 1-30 generated tokens, K = 3) on a cache that
    holds just one request of the longest length: every step respects the token budget and the cache,
    every decode has its blocks, and every request finishes (no deadlock, no livelock)."""
    import random

    rng = random.Random(seed)
    blocks = BlockManager(18, 4)  # 72 positions: one request of 40 + 30 tokens plus 1 + K
    sched = Scheduler(24, max_running=6, tokens_per_decode_request=4, blocks=blocks)
    seqs = [_seq(i, rng.randint(1, 40)) for i in range(30)]
    wanted = {s.request_id: rng.randint(1, 30) for s in seqs}
    for s in seqs:
        sched.add(s)
    for _ in range(5000):
        if not sched.num_running and not sched.num_waiting:
            break
        step = sched.schedule()
        assert len(step.decodes) * 4 + step.num_batched_tokens <= 24
        assert blocks.num_used_blocks <= 18 and not step.is_empty
        for seq in step.decodes:
            assert len(seq.block_table) * 4 >= seq.num_computed + 4
        for seq, n in step.prefills:
            assert len(seq.block_table) * 4 >= seq.num_computed + n
        _advance(step)
        for seq in sched.running:
            if len(seq.output_token_ids) >= wanted[seq.request_id]:
                seq.finish("length")
        sched.release_finished()
    assert all(s.is_finished for s in seqs) and blocks.num_used_blocks == 0
