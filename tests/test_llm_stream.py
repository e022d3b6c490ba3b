"""LLM.stream: lazy feeding, early stop without losing in-flight answers, and a clean engine after close."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from tiny_llm import save_tiny

from flyspec import LLM, SamplingParams
from flyspec.llm import GenerationRequest

GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    path = save_tiny(tmp_path_factory.mktemp("stream") / "tiny", seed=0)
    return LLM(str(path), dtype="float32", max_num_seqs=4)


def _requests(n: int, pulled: list[int]) -> Iterator[GenerationRequest]:
    for i in range(n):
        pulled.append(i)
        yield GenerationRequest(prompt=f"w{i + 1} w2 w3", params=GREEDY, request_id=f"r{i}")


def test_stream_pulls_lazily_and_matches_generate(llm: LLM) -> None:
    """stream() never holds more than max_in_flight requests, yields every request once, and each output
    equals what generate() produces for the same prompt (greedy, float32)."""
    pulled: list[int] = []
    seen = []
    for out in llm.stream(_requests(10, pulled), max_in_flight=3):
        # When an output arrives, at most 3 requests were ever pulled beyond those already yielded.
        assert len(pulled) - len(seen) <= 3
        seen.append(out)
    assert sorted(o.request_id for o in seen) == [f"r{i}" for i in range(10)]
    expected = llm.generate([f"w{i + 1} w2 w3" for i in range(10)], GREEDY, use_tqdm=False)
    by_id = {o.request_id: o for o in seen}
    assert [by_id[f"r{i}"].outputs[0].token_ids for i in range(10)] == [
        e.outputs[0].token_ids for e in expected
    ]


def test_an_exhausted_source_drains_in_flight_requests(llm: LLM) -> None:
    """A feed that stops early (as a sequential gate does at its boundary) still gets the answers of the
    requests already in flight: ending the iterable is not an abort."""

    def feed() -> Iterator[GenerationRequest]:
        for i in range(3):
            yield GenerationRequest(prompt="w5 w6", params=GREEDY, request_id=f"d{i}")

    outs = list(llm.stream(feed(), max_in_flight=3))
    assert sorted(o.request_id for o in outs) == ["d0", "d1", "d2"]
    assert all(o.finished and len(o.outputs[0].token_ids) == 5 for o in outs)


def test_closing_the_stream_aborts_what_is_in_flight(llm: LLM) -> None:
    """Breaking out of the loop aborts the requests still running, so the engine is empty afterwards."""
    pulled: list[int] = []
    stream = llm.stream(_requests(8, pulled), max_in_flight=4)
    next(stream)
    stream.close()
    assert not llm.has_unfinished_requests()


def test_abort_frees_a_request_in_flight_and_its_slot_goes_to_the_next(llm: LLM) -> None:
    """LLM.abort (asked here from another thread, as the gate asks it while its engine thread streams)
    removes a request in flight: the stream yields nothing for it, the slot it held pulls the next
    request, every other request still finishes with its full output, and the engine ends empty."""
    import threading

    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)

    def feed() -> Iterator[GenerationRequest]:
        yield GenerationRequest(prompt="w1 w2", params=long, request_id="slow")
        for i in range(4):
            yield GenerationRequest(prompt=f"w{i + 3} w4", params=GREEDY, request_id=f"f{i}")

    outs = []
    for out in llm.stream(feed(), max_in_flight=2):
        outs.append(out)
        if len(outs) == 1:  # "slow" is in flight with 40 tokens to go
            aborter = threading.Thread(target=llm.abort, args=("slow",))
            aborter.start()
            aborter.join()
    assert sorted(o.request_id for o in outs) == ["f0", "f1", "f2", "f3"]
    assert all(len(o.outputs[0].token_ids) == 5 for o in outs)
    assert not llm.has_unfinished_requests()
    llm.abort("never-added")  # an id that is not in flight is ignored
    assert [o.request_id for o in llm.stream(feed(), max_in_flight=2)][-1] == "slow"


def test_a_refused_request_names_itself_and_leaves_the_engine_clean(llm: LLM) -> None:
    """A request the engine refuses raises ValueError with its id; the others are aborted."""
    items = [
        GenerationRequest(prompt="w1", params=GREEDY, request_id="ok"),
        GenerationRequest(prompt="", params=GREEDY, request_id="empty"),
    ]
    with pytest.raises(ValueError, match="request 'empty': the prompt is empty"):
        list(llm.stream(items))
    assert not llm.has_unfinished_requests()


def test_a_request_needs_exactly_one_of_prompt_or_messages() -> None:
    """GenerationRequest refuses an empty or ambiguous request at construction."""
    with pytest.raises(ValueError, match="exactly one of prompt or messages"):
        GenerationRequest()
    with pytest.raises(ValueError, match="exactly one of prompt or messages"):
        GenerationRequest(prompt="a", messages=[{"role": "user", "content": "b"}])


def test_prompts_stream_incremental_outputs_that_add_up_to_generate(llm: LLM) -> None:
    """stream(prompts, params) yields deltas as tokens arrive (README's example): per request, the pieces of
    text and token ids concatenate to exactly what generate() returns, several pieces arrive before the
    last, and only the last is finished."""
    prompts = ["w1 w2 w3", "w4 w5"]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    pieces: dict[str, list] = {}
    for delta in llm.stream(prompts, params):
        pieces.setdefault(delta.request_id, []).append(delta)
    expected = llm.generate(prompts, params, use_tqdm=False)
    assert len(pieces) == 2
    for deltas, full in zip(pieces.values(), expected, strict=True):
        assert len(deltas) > 1
        assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
        assert "".join(d.outputs[0].text for d in deltas) == full.outputs[0].text
        assert sum((d.outputs[0].token_ids for d in deltas), []) == full.outputs[0].token_ids


def test_one_text_prompt_streams_and_requests_refuse_separate_params(llm: LLM) -> None:
    """A single text prompt is one request; GenerationRequest items carry their own params, so passing
    sampling_params beside them is an error rather than silently ignored."""
    deltas = list(llm.stream("w1 w2", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)))
    assert len({d.request_id for d in deltas}) == 1 and deltas[-1].finished
    with pytest.raises(ValueError, match="sampling_params goes with prompts"):
        llm.stream([GenerationRequest(prompt="w1")], GREEDY)


def test_warm_up_is_bounded_in_time_and_names_faster_options(llm: LLM) -> None:
    """warm_up() generates its tokens and leaves the engine idle; with a time limit the machine cannot meet
    it stops with TooSlowError, which says the CPU is too slow and names faster options, and the engine is
    still idle and usable afterwards."""
    from flyspec.llm import TooSlowError

    assert llm.warm_up() >= 0
    with pytest.raises(TooSlowError, match="too slow for this configuration.*Faster options: .*auto"):
        llm.warm_up(max_tokens=50, time_limit_s=0.0)
    assert llm.generate(["w1"], GREEDY, use_tqdm=False)[0].finished
