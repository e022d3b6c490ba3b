"""The engine's step loop: schedule -> prefill chunks -> draft -> target verify -> verify() -> commit.

Target cache invariant (its length lives on each Sequence as `num_computed`; the cache never tracks
it): after a request's prompt is in, `num_computed == num_tokens - 1`; each decode step feeds the newest
token plus K_b draft tokens at position `num_computed`, and afterwards keeps the newest token and the `a`
accepted drafts, so the invariant holds again (rejected positions are simply overwritten). The drafter
owns its own draft-side lengths behind the `Drafter` interface (engine/drafters/base.py): the engine
tells it what the target prefilled and what verification kept, and never asks which drafter it is.

Without a speculative config the same loop decodes one token per request per step (K = 0).

Exactness: in float32, greedy speculative output is token-identical to target-only greedy output. In
bfloat16 the (1 + K)-token verify pass may round differently from one-token decoding, so at rare
near-ties the two can pick different tokens; that is expected (docs/verification.md), not a bug.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from flyspec.budget import capacity
from flyspec.config import EngineConfig, log_lossy_warning
from flyspec.engine.drafters.base import Drafter, Proposal
from flyspec.engine.drafters.build import build_drafter
from flyspec.engine.model_runner import ModelRunner, logits_to_probs, sample_tokens
from flyspec.engine.scheduler import Scheduler
from flyspec.engine.sequence import Sequence
from flyspec.engine.timing import StepClock, StepTiming
from flyspec.models.loader import LoadedModel, load_model
from flyspec.outputs import RequestOutput
from flyspec.sampling_params import SamplingParams
from flyspec.spec_decode.metrics import SpecDecodeStats
from flyspec.spec_decode.verify import FlyParams, verify

logger = logging.getLogger("flyspec.engine")

DEFAULT_MAX_MODEL_LEN = 4096
"""max_model_len when unset: min(the model's max_position_embeddings, 4096), to bound cache growth."""


class LLMEngine:
    """Continuous-batching engine with optional speculative decoding (standard or FLy verification)."""

    def __init__(
        self, config: EngineConfig, *, target: LoadedModel | None = None, draft: LoadedModel | None = None
    ) -> None:
        """Start an engine for `config`; `target` / `draft` are models already loaded for `config.model`
        and the speculative config's `model` (then they are used as they are, not loaded again)."""
        self.config = config
        spec = config.speculative_config
        self.k = config.num_speculative_tokens
        # Budget arithmetic first: a budget that cannot run one request fails before any weights load.
        self.capacity = capacity(config.max_num_batched_tokens, config.max_num_seqs, 1 + self.k)

        if target is None:
            target = load_model(config.model, config.dtype, config.device, config.quantization)
        _check_quantized_as_configured("target", target, config.quantization)
        self.tokenizer = target.tokenizer
        self.max_model_len = _resolve_max_model_len(
            config.max_model_len, target.model.max_position_embeddings
        )
        self.vocab_size: int = target.model.vocab_size
        self.eos_token_ids = _eos_token_ids(target)
        slots = self.capacity.max_running
        self._clock = StepClock(target.model.device)
        self._verify_timer = self._clock.part("verify_s")
        # Verification writes up to K positions past the last kept token.
        cache_len = self.max_model_len + self.k + 1
        self.target = ModelRunner(target.model, slots, cache_len, timer=self._clock.part("target_forward_s"))

        self.drafter: Drafter | None = None
        if spec is not None:
            if spec.method == "draft_model" and draft is None:
                assert spec.model is not None
                draft = load_model(spec.model, config.dtype, config.device, config.draft_quantization)
            if draft is not None:
                _check_quantized_as_configured("draft", draft, config.draft_quantization)
            self.drafter = build_drafter(
                spec,
                target,
                draft,
                num_slots=slots,
                max_model_len=self.max_model_len,
                timer=self._clock.part("draft_forward_s"),
            )
        self.fly: FlyParams | None = spec.fly_params(self.vocab_size) if spec is not None else None

        self.scheduler = Scheduler(config.max_num_batched_tokens, slots, 1 + self.k)
        self.stats = SpecDecodeStats(num_speculative_tokens=self.k)
        self._requests: dict[str, Sequence] = {}
        self._num_added = 0
        logger.info(self.capacity.describe())
        if self.is_lossy:
            log_lossy_warning(logger)

    # ------------------------------------------------------------------ public API

    @property
    def is_lossy(self) -> bool:
        """True when the engine runs FLy verification."""
        return self.fly is not None

    @property
    def max_running(self) -> int:
        """The admission cap: min(max_num_seqs, max_num_batched_tokens // (1 + K))."""
        return self.capacity.max_running

    @property
    def num_running(self) -> int:
        """Requests holding a cache slot."""
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        """Requests queued for a slot."""
        return self.scheduler.num_waiting

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting or running."""
        return bool(self._requests)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        prompt_text: str | None = None,
    ) -> None:
        """Queue a request. Raises ValueError (and changes nothing) for a bad request.

        prompt: text (tokenised with the tokenizer's default special tokens) or token ids.
        prompt_text: the text to report as the prompt when `prompt` is token ids (e.g. a chat template).
        """
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id={request_id!r}: must be a non-empty string")
        if request_id in self._requests:
            raise ValueError(f"request_id={request_id!r} is already in use by an unfinished request")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        token_ids = self._tokenize(prompt)
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens, but max_model_len={self.max_model_len} must leave "
                "room for at least one generated token; shorten the prompt or raise max_model_len"
            )
        if params.verification == "fly" and not self.is_lossy:
            raise ValueError(
                "verification='fly' needs an engine started with speculative_config "
                "rejection_sample_method='fly'"
            )
        seed = params.seed if params.seed is not None else self.config.seed + self._num_added
        text = prompt if isinstance(prompt, str) else prompt_text
        seq = Sequence(request_id, text, token_ids, params, seed, self.eos_token_ids)
        self._num_added += 1
        self._requests[request_id] = seq
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> None:
        """Stop a request and free its slot (no further output is produced; unknown ids are ignored)."""
        seq = self.scheduler.abort(request_id)
        if seq is not None:
            seq.finish("abort")
            self._forget(seq)

    def step(self) -> list[RequestOutput]:
        """Run one engine step; return an output for every request that got tokens or finished."""
        self._clock.begin_step()
        planned = self.scheduler.schedule()
        touched: list[Sequence] = []
        if planned.decodes:
            self._decode(planned.decodes)
            touched.extend(planned.decodes)
        if planned.prefills:
            touched.extend(self._prefill(planned.prefills))
        for seq in self.scheduler.release_finished():
            self._forget(seq)
        outputs = [seq.to_output() for seq in touched]
        self._clock.end_step()
        return outputs

    def record_step_timings(self, enabled: bool = True) -> None:
        """Start recording where each step's time goes into `step_timings` (a fresh, empty list), or stop
        and drop the records with enabled=False. Recording adds clock reads around the timed parts (and,
        on CUDA, device synchronisations), so leave it off outside profiling."""
        self._clock.start(enabled)

    @property
    def step_timings(self) -> list[StepTiming] | None:
        """One StepTiming per step since `record_step_timings()`, or None while not recording."""
        return self._clock.records

    # ------------------------------------------------------------------ internals

    def _forget(self, seq: Sequence) -> None:
        self._requests.pop(seq.request_id, None)
        if self.drafter is not None:
            self.drafter.release(seq)

    def _tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty")
            ids = list(self.tokenizer(prompt).input_ids)
            if not ids:
                raise ValueError(f"the prompt {prompt!r} tokenises to no tokens")
            return ids
        if not isinstance(prompt, list | tuple) or not prompt:
            raise ValueError("the prompt must be a non-empty string or a non-empty list of token ids")
        bad = [
            t for t in prompt if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size
        ]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        return list(prompt)

    def _detokenize(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def _commit(self, seq: Sequence, tokens: list[int]) -> int:
        kept = seq.append_tokens(tokens, self._detokenize, self.max_model_len)
        seq.num_computed = seq.num_tokens - 1
        self.stats.generation_tokens += kept
        return kept

    def _prefill(self, chunks: list[tuple[Sequence, int]]) -> list[Sequence]:
        """Prefill prompt chunks in one padded pass (target and draft); sample the first token of every
        request whose prompt is now complete, and return those requests."""
        rows = [seq.prompt_token_ids[seq.num_computed : seq.num_computed + n] for seq, n in chunks]
        slots = [seq.slot for seq, _ in chunks]
        starts = [seq.num_computed for seq, _ in chunks]
        done = [seq.num_computed + n == seq.num_prompt_tokens for seq, n in chunks]
        keep = [[n - 1] if last else [] for (_, n), last in zip(chunks, done, strict=True)]
        logits = self.target.forward(rows, slots, starts, keep)
        if self.drafter is not None:
            self.drafter.prefill(rows, slots, starts)
        for seq, n in chunks:
            seq.num_computed += n
            self.stats.prompt_tokens += n
        finished = [seq for (seq, _), last in zip(chunks, done, strict=True) if last]
        if finished:
            assert logits is not None
            probs = logits_to_probs(logits, [s.params for s in finished])
            uniform = torch.cat([s.draw_uniforms(1) for s in finished])
            tokens = sample_tokens(probs, [s.params.greedy for s in finished], uniform)
            for seq, token in zip(finished, tokens, strict=True):
                self._commit(seq, [token])
        return finished

    def _decode(self, seqs: list[Sequence]) -> None:
        """One decode step for running requests: draft, verify in one target pass, commit, roll back."""
        k = self.k
        # Every request draws the same 2K + 1 numbers per step from its own stream, whatever the batch.
        draws = torch.stack([s.draw_uniforms(2 * k + 1) for s in seqs])
        draft_u, verify_u, sample_u = draws[:, :k], draws[:, k : 2 * k], draws[:, 2 * k]
        slots, starts = [s.slot for s in seqs], [s.num_computed for s in seqs]
        if self.drafter is None:
            logits = self.target.forward([[s.token_ids[-1]] for s in seqs], slots, starts, [[0]] * len(seqs))
            assert logits is not None
            probs = logits_to_probs(logits, [s.params for s in seqs])
            tokens = sample_tokens(probs, [s.params.greedy for s in seqs], sample_u)
            for seq, token in zip(seqs, tokens, strict=True):
                self._commit(seq, [token])
            return

        proposal = self.drafter.propose(seqs, draft_u)
        num_draft = proposal.num_tokens.tolist()
        drafts = proposal.token_ids.tolist()
        rows = [[s.token_ids[-1], *drafts[b][: num_draft[b]]] for b, s in enumerate(seqs)]
        logits = self.target.forward(rows, slots, starts, [list(range(n + 1)) for n in num_draft])
        assert logits is not None
        row_params = [s.params for s, n in zip(seqs, num_draft, strict=True) for _ in range(n + 1)]
        target_probs = _to_padded_rows(logits_to_probs(logits, row_params), num_draft, k)
        greedy = torch.tensor([s.params.greedy for s in seqs], dtype=torch.bool)
        accepted, forgiven, final_ids = self._verify(seqs, proposal, target_probs, greedy, verify_u, sample_u)
        self.drafter.commit(seqs, accepted)

        for b, seq in enumerate(seqs):
            old_outputs = len(seq.output_token_ids)
            self._record(
                seq, num_draft[b], accepted[b], len(forgiven[b]), [old_outputs + i for i in forgiven[b]]
            )
            self._commit(seq, final_ids[b])
            # A stop condition may have cut the step's tokens short; forget forgiven positions past it.
            seq.metrics.forgiven_positions = [
                i for i in seq.metrics.forgiven_positions if i < len(seq.output_token_ids)
            ]

    def _verify(
        self,
        seqs: list[Sequence],
        proposal: Proposal,
        target_probs: torch.Tensor,
        greedy: torch.Tensor,
        verify_u: torch.Tensor,
        sample_u: torch.Tensor,
    ) -> tuple[list[int], list[list[int]], list[list[int]]]:
        """verify() for all rows: FLy for rows that allow it, standard for the rest (a request with
        verification="standard" in a FLy engine), as at most two calls. Returns per-row accepted counts,
        forgiven draft positions and the tokens to commit."""
        use_fly = [self.fly is not None and s.params.verification != "standard" for s in seqs]
        accepted = [0] * len(seqs)
        forgiven: list[list[int]] = [[] for _ in seqs]
        final_ids: list[list[int]] = [[] for _ in seqs]
        for fly_group in (False, True):
            idx = [b for b in range(len(seqs)) if use_fly[b] == fly_group]
            if not idx:
                continue
            # The usual case is one group of all rows: then no copies of the [B, K+1, V] probabilities.
            sel = None if len(idx) == len(seqs) else idx
            with self._verify_timer:
                out = verify(
                    _rows(proposal.token_ids, sel),
                    _rows(target_probs, sel),
                    None if proposal.probs is None else _rows(proposal.probs, sel),
                    greedy=_rows(greedy, sel),
                    fly=self.fly if fly_group else None,
                    num_draft_tokens=_rows(proposal.num_tokens, sel),
                    uniform=_rows(verify_u, sel),
                    sample_uniform=_rows(sample_u, sel),
                )
            num_accepted, token_ids = out.num_accepted.tolist(), out.token_ids.tolist()
            forgiven_mask = out.forgiven.tolist()
            for j, b in enumerate(idx):
                accepted[b] = num_accepted[j]
                forgiven[b] = [i for i, f in enumerate(forgiven_mask[j]) if f]
                final_ids[b] = token_ids[j][: accepted[b] + 1]
        return accepted, forgiven, final_ids

    def _record(
        self, seq: Sequence, num_draft: int, accepted: int, forgiven: int, positions: list[int]
    ) -> None:
        self.stats.record_verification(num_draft, accepted, forgiven)
        if num_draft == 0:
            return
        m = seq.metrics
        m.num_drafts += 1
        m.num_draft_tokens += num_draft
        m.num_accepted_tokens += accepted
        m.num_forgiven_tokens += forgiven
        m.forgiven_positions.extend(positions)


def _rows(tensor: torch.Tensor, rows: list[int] | None) -> torch.Tensor:
    """The given rows of a tensor (all of them when rows is None)."""
    return tensor if rows is None else tensor[torch.tensor(rows, device=tensor.device)]


def _to_padded_rows(flat: torch.Tensor, num_draft: list[int], k: int) -> torch.Tensor:
    """[sum(1 + K_b), V] probabilities -> [B, K + 1, V] (unused positions are zero)."""
    b = len(num_draft)
    if all(n == k for n in num_draft):
        return flat.view(b, k + 1, -1)
    out = flat.new_zeros((b, k + 1, flat.shape[-1]))
    rows = torch.tensor([r for r, n in enumerate(num_draft) for _ in range(n + 1)], device=flat.device)
    cols = torch.tensor([c for n in num_draft for c in range(n + 1)], device=flat.device)
    out[rows, cols] = flat
    return out


def _check_quantized_as_configured(role: str, loaded: LoadedModel, quantization: str | None) -> None:
    # A preloaded model (the benchmarks share weights across engines) must be what the config says.
    if loaded.quantization != quantization:
        raise ValueError(
            f"the preloaded {role} model {loaded.path} has quantization={loaded.quantization!r}, but the "
            f"engine config asks for quantization={quantization!r}"
        )


def _resolve_max_model_len(requested: int | None, max_position_embeddings: int) -> int:
    if requested is None:
        return min(max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
    if requested > max_position_embeddings:
        raise ValueError(
            f"max_model_len={requested} exceeds the model's max_position_embeddings="
            f"{max_position_embeddings}; use at most {max_position_embeddings}"
        )
    return requested


def _eos_token_ids(loaded: LoadedModel) -> frozenset[int]:
    """End-of-sequence ids from the tokenizer, the model config and generation_config.json if present."""
    from transformers import GenerationConfig

    ids: set[int] = set()
    candidates: list[object] = [
        loaded.tokenizer.eos_token_id,
        getattr(loaded.hf_config, "eos_token_id", None),
    ]
    # No generation_config.json (e.g. a .gguf file) is fine: the other sources suffice.
    with contextlib.suppress(OSError, ValueError, TypeError):
        candidates.append(GenerationConfig.from_pretrained(loaded.path).eos_token_id)
    for value in candidates:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(v for v in value if isinstance(v, int))
    return frozenset(ids)
