"""Runs a sweep: loads every arm's engine once, warms each arm up, then times the arms interleaved.

Timing: tokens/s = generated tokens / wall time of `LLM.generate` (or the peer's `generate`), summed over
the arm's waves and repetitions; model loading and warm-up are never inside a timed region. Each
repetition runs every arm once in turn, in alternating order (A..Z, then Z..A), so slow drift of a shared
machine hits all arms alike. Peak RSS is sampled by a background thread while each arm runs.

Engines: one per (weight format, drafter, K, verifier), created lazily, where the verifier is a lossy
arm's policy with its settings and lossless prefix. A standard arm runs on a lossy engine of the same
format, drafter and K when the sweep has one (the first lossy arm's at its policy's defaults, else the
first), as requests with `SamplingParams(verification="standard")` (lossless verification per request).
Model weights are loaded once per (model, weight format) and handed to every engine through
`LLM.from_config(config, target=..., draft=...)`; a loaded model holds only weights (KV caches belong to
each engine), so sharing it is safe. A model of format "auto" is the exception: the fastest format is
measured for the engine's own workload (its K and slots), so each such engine loads its own. `release()`
drops every engine and model, for a caller that measures one engine at a time (flyspec/bench/llama_cpp.py).
"""

from __future__ import annotations

import gc
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from flyspec.bench.prompts import BenchPrompt
from flyspec.bench.sweep import Arm, split_format
from flyspec.outputs import AcceptanceCounts


@dataclass
class Measurement:
    """One timed execution of one arm (all its waves, one repetition).

    counts: acceptance counters summed over the arm's requests (None for the peer); target_forwards
    counts the peer's target forward passes (None for flyspec). decode_tokens / decode_seconds: tokens after
    each request's first one, and the time from a wave's first first-token to its last finish (flyspec
    only: the prefill share of the wall time left out). outputs maps prompt id -> generated token ids.
    """

    tokens: int
    seconds: float
    peak_rss_bytes: int
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    counts: AcceptanceCounts | None = None
    target_forwards: int | None = None
    outputs: dict[str, list[int]] = field(default_factory=dict)


class PeakRSS:
    """Context manager sampling this process's resident set size every `interval` seconds; `.peak` is
    the largest sample (bytes). The sampler only wakes briefly, so it does not disturb the timings."""

    def __init__(self, interval: float = 0.05) -> None:
        import psutil

        self._process = psutil.Process(os.getpid())
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self.peak = 0

    def _sample(self) -> None:
        while True:
            self.peak = max(self.peak, self._process.memory_info().rss)
            if self._stop.wait(self._interval):
                return

    def __enter__(self) -> PeakRSS:
        self.peak = self._process.memory_info().rss
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._process.memory_info().rss)


Verifier = tuple[str, str, int]
"""A lossy engine's verification: (policy name, its settings as sorted JSON, lossless prefix)."""
EngineKey = tuple[str | None, str | None, int | None, Verifier | None]


def _verifier(arm: Arm) -> Verifier:
    return (arm.method, json.dumps(arm.settings, sort_keys=True), arm.lossless_prefix)


def engine_keys(arms: list[Arm]) -> dict[str, EngineKey]:
    """label -> (quantization, drafter, K, verifier) of the engine each flyspec arm runs on (see module
    docstring)."""
    lossy: dict[tuple[str | None, str | None, int | None], Verifier] = {}
    candidates = [a for a in arms if a.backend == "flyspec" and a.lossy]
    for arm in sorted(candidates, key=lambda a: not a.at_defaults):  # stable: defaults first, in order
        lossy.setdefault((arm.quantization, arm.drafter, arm.k), _verifier(arm))
    keys: dict[str, EngineKey] = {}
    for arm in arms:
        if arm.backend != "flyspec":
            continue
        q = arm.quantization
        if arm.method == "target":
            keys[arm.label] = (q, None, None, None)
        elif arm.lossy:
            keys[arm.label] = (q, arm.drafter, arm.k, _verifier(arm))
        else:
            keys[arm.label] = (q, arm.drafter, arm.k, lossy.get((q, arm.drafter, arm.k)))
    return keys


class BenchRunner:
    """Holds the engines (and the peer) of one sweep and runs single arms on request."""

    def __init__(
        self,
        model: str,
        arms: list[Arm],
        *,
        dtype: str,
        device: str,
        ignore_eos: bool,
        seed: int = 0,
        prefix_caching: bool = True,
    ) -> None:
        self.model = model
        self.dtype = dtype
        self.device = device
        self.ignore_eos = ignore_eos
        self.seed = seed
        self.prefix_caching = prefix_caching
        self.keys = engine_keys(arms)
        # The speculative config of each engine: its lossy arm's (standard arms ride on it), else a
        # standard arm's.
        self._specs: dict[EngineKey, dict[str, Any] | None] = {}
        for arm in sorted(arms, key=lambda a: not a.lossy):
            if arm.backend == "flyspec":
                self._specs.setdefault(self.keys[arm.label], arm.speculative_config())
        # The format the tokenizer and dtype are read from: the first flyspec arm's (so an int8-only sweep
        # never loads the unquantized weights).
        self._first_format = split_format(
            next((a.quantization for a in arms if a.backend == "flyspec"), None)
        )[0]
        self.slots: dict[EngineKey, int] = {}
        for arm in arms:
            if arm.backend == "flyspec":
                key = self.keys[arm.label]
                self.slots[key] = max(self.slots.get(key, 1), arm.batch_size)
        self.load_seconds = 0.0
        # (model name, quantization) -> LoadedModel (one dtype and device per sweep)
        self._weights: dict[tuple[str, str | None], Any] = {}
        self._engines: dict[EngineKey, Any] = {}
        self._peer: Any = None

    @property
    def tokenizer(self) -> Any:
        """The target's tokenizer (loads the target on first use)."""
        return self._loaded(self.model, self._first_format).tokenizer

    @property
    def target_dtype(self) -> Any:
        """The torch dtype the target's weights were loaded in (the peer uses the same)."""
        return self._loaded(self.model, self._first_format).dtype

    def _loaded(self, name: str, quantization: str | None) -> Any:
        """The LoadedModel of `name` in a weight format, loaded on first use and then shared by every
        engine."""
        if (name, quantization) not in self._weights:
            from flyspec.models.loader import load_model

            self._weights[name, quantization] = load_model(name, self.dtype, self.device, quantization)
        return self._weights[name, quantization]

    def _shared(self, name: str, quantization: str | None) -> Any:
        """The loaded model an engine is given, or None for "auto", which the engine loads itself (the
        format is chosen for its workload)."""
        return None if quantization == "auto" else self._loaded(name, quantization)

    def release(self) -> None:
        """Drop every flyspec engine and loaded model, so that their memory (KV caches, weights) is free
        before the next engine loads; a later arm builds its engine again."""
        self._engines.clear()
        self._weights.clear()
        gc.collect()

    def _speculative_config(self, key: EngineKey) -> dict[str, Any] | None:
        spec = self._specs.get(key)
        if spec is None:
            return None
        draft_q = split_format(key[0])[1]
        if spec.get("method") == "draft_model" and draft_q is not None:
            spec = {**spec, "quantization": draft_q}
        return spec

    def engine_for(self, arm: Arm) -> Any:
        """The LLM object a flyspec arm runs on (built on first use, sharing loaded weights)."""
        from flyspec.config import EngineConfig
        from flyspec.llm import LLM

        key = self.keys.get(arm.label, (arm.quantization, None, None, None))
        if key not in self._engines:
            start = time.perf_counter()
            config = EngineConfig(
                model=self.model,
                speculative_config=self._speculative_config(key),
                dtype=self.dtype,
                device=self.device,
                max_num_seqs=self.slots.get(key, 1),
                seed=self.seed,
                quantization=split_format(key[0])[0],
                enable_prefix_caching=self.prefix_caching,
            )
            spec = config.speculative_config
            draft = None
            if spec is not None and spec.model is not None:
                draft = self._shared(spec.model, config.draft_quantization)
            target = self._shared(self.model, config.quantization)
            self._engines[key] = LLM.from_config(config, target=target, draft=draft)
            self.load_seconds += time.perf_counter() - start
        return self._engines[key]

    def _hf(self) -> Any:
        if self._peer is None:
            from flyspec.bench.peer_hf import HFPeer

            self._peer = HFPeer(self.model, self.target_dtype, self.device)
        return self._peer

    def prepare(self, arm: Arm) -> None:
        """Load what the arm needs (engine or peer models), outside any timed region."""
        if arm.backend == "flyspec":
            self.engine_for(arm)
        else:
            start = time.perf_counter()
            self._hf().load(arm.drafter)
            self.load_seconds += time.perf_counter() - start

    def sampling_params(self, arm: Arm, max_tokens: int) -> Any:
        """Greedy decoding of `max_tokens` tokens; a standard arm on a lossy engine forces lossless
        verification per request."""
        from flyspec.sampling_params import SamplingParams

        return SamplingParams(
            temperature=0.0,
            max_tokens=max_tokens,
            ignore_eos=self.ignore_eos,
            verification="standard" if arm.method == "standard" else None,
        )

    def run(self, arm: Arm, arm_waves: list[list[BenchPrompt]], max_tokens: int) -> Measurement:
        """Time the arm once over all its waves (each wave = batch_size concurrent requests)."""
        with PeakRSS() as rss:
            if arm.backend == "flyspec":
                m = self._run_flyspec(arm, arm_waves, max_tokens)
            else:
                m = self._run_peer(arm, arm_waves, max_tokens)
        m.peak_rss_bytes = rss.peak
        return m

    def _run_flyspec(self, arm: Arm, arm_waves: list[list[BenchPrompt]], max_tokens: int) -> Measurement:
        llm = self.engine_for(arm)
        params = self.sampling_params(arm, max_tokens)
        m = Measurement(tokens=0, seconds=0.0, peak_rss_bytes=0, counts=AcceptanceCounts())
        for wave in arm_waves:
            start = time.perf_counter()
            outs = llm.generate([p.token_ids for p in wave], params, use_tqdm=False)
            m.seconds += time.perf_counter() - start
            firsts = [o.metrics.first_token_time for o in outs if o.metrics.first_token_time is not None]
            finishes = [o.metrics.finished_time for o in outs if o.metrics.finished_time is not None]
            if firsts and finishes:
                m.decode_seconds += max(finishes) - min(firsts)
            for prompt, out in zip(wave, outs, strict=True):
                ids = out.outputs[0].token_ids
                m.tokens += len(ids)
                m.decode_tokens += max(len(ids) - 1, 0)
                m.outputs.setdefault(prompt.id, list(ids))
                m.counts += out.metrics.counts  # type: ignore[operator]
        return m

    def _run_peer(self, arm: Arm, arm_waves: list[list[BenchPrompt]], max_tokens: int) -> Measurement:
        if arm.batch_size != 1:
            raise ValueError(f"{arm.label}: the peer runs at batch size 1 only")
        peer = self._hf()
        m = Measurement(tokens=0, seconds=0.0, peak_rss_bytes=0, target_forwards=0)
        for wave in arm_waves:
            (prompt,) = wave
            start = time.perf_counter()
            out = peer.generate(prompt.token_ids, max_tokens, self.ignore_eos, arm.drafter, arm.k)
            m.seconds += time.perf_counter() - start
            m.tokens += len(out.token_ids)
            m.target_forwards += out.target_forwards  # type: ignore[operator]
            m.outputs.setdefault(prompt.id, out.token_ids)
        return m


def run_interleaved(
    runner: BenchRunner,
    arms: list[Arm],
    arm_waves: dict[str, list[list[BenchPrompt]]],
    *,
    max_tokens: int,
    repeats: int,
    warmup_tokens: int,
    on_progress: Callable[[str], None] = lambda _label: None,
) -> dict[str, list[Measurement]]:
    """Load and warm up every arm, then run `repeats` interleaved repetitions; label -> measurements.

    Warm-up: each arm runs its first wave once with `warmup_tokens` new tokens (untimed), which builds
    the engines, touches every weight and settles the allocator before the first timed run.
    `on_progress(label)` is called before each warm-up and timed run.
    """
    for arm in arms:
        on_progress(f"load + warm-up: {arm.label}")
        runner.prepare(arm)
        runner.run(arm, arm_waves[arm.label][:1], warmup_tokens)
    results: dict[str, list[Measurement]] = {arm.label: [] for arm in arms}
    for rep in range(repeats):
        order = arms if rep % 2 == 0 else arms[::-1]
        for arm in order:
            on_progress(f"run {rep + 1}/{repeats}: {arm.label}")
            results[arm.label].append(runner.run(arm, arm_waves[arm.label], max_tokens))
    return results
