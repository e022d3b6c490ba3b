"""The engine's step loop: schedule -> prefill chunks -> draft -> target verify -> verify() -> commit.

KV memory: the target (and a draft model) keep keys and values in a paged cache whose blocks the
scheduler hands out as requests grow and takes back when they end (engine/kv_blocks.py), within
`kv_cache_memory_bytes`; identical prompt blocks are shared (prefix caching).

Target cache invariant (its length lives on each Sequence as `num_computed`; the cache never tracks
it): after a request's prompt is in, `num_computed == num_tokens - 1`; each decode step feeds the newest
token plus K_b draft tokens at position `num_computed`, and afterwards keeps the newest token and the `a`
accepted drafts, so the invariant holds again (rejected positions are simply overwritten). The drafter
owns its own draft-side lengths behind the `Drafter` interface (engine/drafters/base.py): the engine
tells it what the target prefilled and what verification kept, and never asks which drafter it is.

Without a speculative config the same loop decodes one token per request per step (K = 0).

Logits processing (penalties, logit bias, grammar masks; engine/logits_processing.py) and logprobs
(engine/logprobs.py) cost nothing for requests that do not use them. A request whose processing,
verification or commit raises (or whose distribution is not finite) fails alone with finish_reason
"error": its KV blocks are freed and the other requests' outputs are exactly what they would be without it.

Exactness: in float32, greedy speculative output is token-identical to target-only greedy output. In
bfloat16 the (1 + K)-token verify pass may round differently from one-token decoding, so at rare
near-ties the two can pick different tokens; that is expected (docs/verification.md), not a bug.
"""

from __future__ import annotations

import contextlib
import logging
import os

import torch

from flyspec.budget import capacity
from flyspec.config import EngineConfig
from flyspec.engine.drafters.base import Drafter, Proposal
from flyspec.engine.drafters.build import build_drafter
from flyspec.engine.kv_blocks import BLOCK_SIZE, BlockManager
from flyspec.engine.logits_processing import RequestLogitsState, TargetProcessing, non_finite_message
from flyspec.engine.logprobs import LogprobsBuilder, prompt_logprobs
from flyspec.engine.model_runner import ModelRunner, sample_tokens
from flyspec.engine.scheduler import Scheduler
from flyspec.engine.sequence import RequestGroup, Sequence
from flyspec.engine.structured import Grammars
from flyspec.engine.timing import StepClock, StepTiming
from flyspec.engine.warmup import WARMUP_TIME_LIMIT_S, WARMUP_TOKENS, warm_up
from flyspec.models.kernel_check import engine_rows
from flyspec.models.loader import LoadedModel, load_model
from flyspec.outputs import PositionLogprobs, RequestOutput
from flyspec.sampling_params import SamplingParams
from flyspec.spec_decode.metrics import SpecDecodeStats
from flyspec.spec_decode.verify import VerificationPolicy, verify

logger = logging.getLogger("flyspec.engine")

DEFAULT_MAX_MODEL_LEN = 4096
"""max_model_len when unset: min(the model's max_position_embeddings, 4096), to bound cache growth."""
DEFAULT_KV_CACHE_SHARE = 0.25
"""kv_cache_memory_bytes when unset: what max_running requests of max_model_len need, but at most this
share of the machine's memory (of the GPU's free memory on CUDA), and at least one such request."""


class LLMEngine:
    """Continuous-batching engine with optional speculative decoding, verified by the configured policy
    (standard, FLy or typical acceptance; docs/verification.md)."""

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

        slots = self.capacity.max_running
        target = self._load_target(target, slots)
        self.tokenizer = target.tokenizer
        self.max_model_len = _resolve_max_model_len(
            config.max_model_len, target.model.max_position_embeddings
        )
        self.vocab_size: int = target.model.vocab_size
        self.eos_token_ids = _eos_token_ids(target)
        self._clock = StepClock(target.model.device)
        self._verify_timer = self._clock.part("verify_s")
        self.stats = SpecDecodeStats(num_speculative_tokens=self.k)
        # The draft loads only once the target's limits are known good (a bad max_model_len fails first).
        draft = self._load_draft(draft, slots)
        if config.batch_invariant:
            for loaded in (target, draft):
                if loaded is not None:
                    loaded.model.enable_batch_invariance()
        self.weight_formats = {"target": _weight_format(target)}
        if draft is not None:
            self.weight_formats["draft"] = _weight_format(draft)
        # One block table per request serves the target and a draft model: a block holds both.
        per_token = target.model.kv_bytes_per_token() + (draft.model.kv_bytes_per_token() if draft else 0)
        self.blocks = self._block_manager(per_token, target.model.device)
        self.target = ModelRunner(
            target.model, self.blocks.num_blocks, BLOCK_SIZE, timer=self._clock.part("target_forward_s")
        )
        self.blocks.add_release_hook(self.target.cache.release)
        self.drafter = self._build_drafter(target, draft)
        self._kv_block_bytes = BLOCK_SIZE * per_token
        self._log_kv_cache(per_token, with_draft=draft is not None)
        # The lossy verification policy (None: standard) and its lossless prefix L.
        self.policy: VerificationPolicy | None = (
            spec.verification_policy(self.vocab_size) if spec is not None else None
        )
        self.lossless_prefix_tokens = (spec.lossless_prefix_tokens or 0) if spec is not None else 0

        self.scheduler = Scheduler(
            config.max_num_batched_tokens, self.capacity.max_running, 1 + self.k, self.blocks
        )
        self.grammars = Grammars(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self.processing = TargetProcessing(self.grammars)
        self.logprobs = LogprobsBuilder(self.tokenizer)
        self._requests: dict[str, RequestGroup] = {}
        self._seqs: dict[str, Sequence] = {}  # every unfinished sample, by its own (unique) id
        self._num_added = 0
        logger.info(self.capacity.describe())
        if self.policy is not None:
            logger.warning(self.policy.lossy_warning())

    # ------------------------------------------------------------------ construction

    def _load_target(self, target: LoadedModel | None, slots: int) -> LoadedModel:
        """The target model: `target` as given, or loaded for config.model; checked against the config."""
        config = self.config
        if target is None:
            target = load_model(
                config.model,
                config.dtype,
                config.device,
                config.quantization,
                kernel_rows=engine_rows(self.k, slots),
            )
        _check_quantized_as_configured("target", target, config.quantization)
        return target

    def _load_draft(self, draft: LoadedModel | None, slots: int) -> LoadedModel | None:
        """The draft model: `draft` as given, loaded when the method needs one, else None; checked."""
        config = self.config
        spec = config.speculative_config
        if spec is not None and spec.method == "draft_model" and draft is None:
            assert spec.model is not None
            draft = load_model(
                spec.model,
                config.dtype,
                config.device,
                config.draft_quantization,
                kernel_rows=engine_rows(self.k, slots, draft=True),
            )
        if draft is not None:
            _check_quantized_as_configured("draft", draft, config.draft_quantization)
        return draft

    def _block_manager(self, per_token: int, device: torch.device) -> BlockManager:
        """The KV blocks that fit kv_cache_memory_bytes at `per_token` bytes per position."""
        # Verification writes up to K positions past the last kept token.
        num_blocks = _kv_cache_blocks(
            self.config.kv_cache_memory_bytes,
            per_token,
            self.max_model_len + self.k + 1,
            self.capacity.max_running,
            device,
        )
        return BlockManager(num_blocks, prefix_caching=self.config.enable_prefix_caching, stats=self.stats)

    def _build_drafter(self, target: LoadedModel, draft: LoadedModel | None) -> Drafter | None:
        """The speculative config's drafter over the engine's KV blocks, or None without one."""
        spec = self.config.speculative_config
        if spec is None:
            return None
        return build_drafter(
            spec,
            target,
            draft,
            blocks=self.blocks,
            max_model_len=self.max_model_len,
            timer=self._clock.part("draft_forward_s"),
        )

    def _log_kv_cache(self, per_token: int, *, with_draft: bool) -> None:
        """Log the KV cache's size and layout."""
        num_blocks = self.blocks.num_blocks
        logger.info(
            "KV cache: %d blocks of %d positions, %.1f MiB for %d positions (%d bytes per position%s); "
            "prefix caching %s",
            num_blocks,
            BLOCK_SIZE,
            num_blocks * self._kv_block_bytes / 2**20,
            num_blocks * BLOCK_SIZE,
            per_token,
            ", target and draft" if with_draft else "",
            "on" if self.config.enable_prefix_caching else "off",
        )

    # ------------------------------------------------------------------ public API

    @property
    def is_lossy(self) -> bool:
        """True when the engine runs a lossy verification policy (FLy, typical acceptance)."""
        return self.policy is not None

    @property
    def max_running(self) -> int:
        """The admission cap: min(max_num_seqs, max_num_batched_tokens // (1 + K))."""
        return self.capacity.max_running

    @property
    def num_running(self) -> int:
        """Requests holding KV cache blocks."""
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        """Requests queued for admission (new, or preempted for lack of KV blocks)."""
        return self.scheduler.num_waiting

    @property
    def kv_cache_capacity_bytes(self) -> int:
        """Bytes of KV cache the engine may use (target and draft together): kv_cache_memory_bytes
        rounded down to whole blocks. On the CPU only the blocks ever written are resident."""
        return self.blocks.num_blocks * self._kv_block_bytes

    @property
    def kv_cache_used_bytes(self) -> int:
        """Bytes of KV cache in the blocks that running requests hold now."""
        return self.blocks.num_used_blocks * self._kv_block_bytes

    @property
    def kv_cache_cached_bytes(self) -> int:
        """Bytes of KV cache kept only for prefix sharing (registered prompt blocks no request holds;
        reused for new requests first when blocks run short)."""
        return self.blocks.num_cached_blocks * self._kv_block_bytes

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
        With params.n > 1 the request runs as n samples (internal ids f"{i}_{request_id}") whose seeds
        are seed + i, and one RequestOutput carries all of them.
        """
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id={request_id!r}: must be a non-empty string")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        sample_ids = [request_id] if params.n == 1 else [f"{i}_{request_id}" for i in range(params.n)]
        if request_id in self._requests or any(i in self._seqs for i in [request_id, *sample_ids]):
            raise ValueError(f"request_id={request_id!r} is already in use by an unfinished request")
        token_ids = self._tokenize(prompt)
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens, but max_model_len={self.max_model_len} must leave "
                "room for at least one generated token; shorten the prompt or raise max_model_len"
            )
        wanted = params.verification
        if wanted not in (None, "standard") and (self.policy is None or wanted != self.policy.name):
            running = "standard" if self.policy is None else self.policy.name
            raise ValueError(
                f"verification={wanted!r} needs an engine started with speculative_config "
                f"rejection_sample_method={wanted!r}; this engine verifies with {running!r}"
            )
        if params.logit_bias is not None:
            bad = [t for t in params.logit_bias if t >= self.vocab_size]
            if bad:
                raise ValueError(
                    f"logit_bias: token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})"
                )
        state = self._logits_state(params, token_ids)
        # Sample i draws from seed + i (mod 2**64, the generator's range); unseeded requests take the engine
        # seed plus their arrival index, each sample counting as one arrival.
        base = params.seed if params.seed is not None else self.config.seed + self._num_added
        text = prompt if isinstance(prompt, str) else prompt_text
        seqs = []
        for i, sample_id in enumerate(sample_ids):
            sample_state = state if i == 0 or state is None else state.fork(token_ids)
            seqs.append(
                Sequence(
                    sample_id,
                    text,
                    token_ids,
                    params,
                    (base + i) % 2**64,
                    self.eos_token_ids,
                    group_id=request_id,
                    index=i,
                    logits_state=sample_state,
                )
            )
        self._num_added += len(seqs)
        self._requests[request_id] = RequestGroup(request_id, seqs)
        for seq in seqs:
            self._seqs[seq.request_id] = seq
            self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> None:
        """Stop a request (all of its samples) and free its KV blocks (no further output is produced; unknown
        ids are ignored)."""
        group = self._requests.pop(request_id, None)
        if group is not None:
            self._abort(group)
            self._update_usage()

    def step(self) -> list[RequestOutput]:
        """Run one engine step; return an output for every request that got tokens or finished."""
        self._clock.begin_step()
        planned = self.scheduler.schedule()
        for seq in planned.preempted:  # its draft state goes too: it computes everything again
            if self.drafter is not None:
                self.drafter.release(seq)
        self.stats.num_preemptions += len(planned.preempted)
        touched: list[Sequence] = []
        if planned.decodes:
            self._decode(planned.decodes)
            touched.extend(planned.decodes)
        if planned.prefills:
            touched.extend(self._prefill(planned.prefills))
        for seq in touched:
            if seq.error is not None:  # a failed sample fails its request: stop the other samples
                self._abort(self._requests[seq.group_id])
        for seq in self.scheduler.release_finished():
            self._release(seq)
        outputs = []
        for group_id in dict.fromkeys(seq.group_id for seq in touched):
            group = self._requests[group_id]
            outputs.append(group.to_output())
            if group.is_finished:
                del self._requests[group_id]
        self._update_usage()
        self._clock.end_step()
        return outputs

    def warm_up(self, max_tokens: int = WARMUP_TOKENS, time_limit_s: float = WARMUP_TIME_LIMIT_S) -> float:
        """Generate a few tokens on this idle engine before real work; returns the seconds taken, raises
        TooSlowError naming faster options past `time_limit_s` (flyspec/engine/warmup.py)."""
        return warm_up(self, max_tokens=max_tokens, time_limit_s=time_limit_s)

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

    def _update_usage(self) -> None:
        self.stats.kv_cache_usage = self.blocks.num_used_blocks / self.blocks.num_blocks

    def _release(self, seq: Sequence) -> None:
        self._seqs.pop(seq.request_id, None)
        if self.drafter is not None:
            self.drafter.release(seq)

    def _abort(self, group: RequestGroup) -> None:
        for seq in group.seqs:
            if self.scheduler.abort(seq.request_id) is not None:
                if not seq.is_finished:
                    seq.finish("abort")
                self._release(seq)

    def _logits_state(self, params: SamplingParams, prompt: list[int]) -> RequestLogitsState | None:
        """The request's processing state, or None when it needs none (the fast path)."""
        if not params.shapes_logits:
            return None
        grammar = None
        if params.structured_outputs is not None:
            grammar = self.grammars.matcher(params.structured_outputs)
        return RequestLogitsState(params, prompt, self.vocab_size, self.target.device, grammar)

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

    def _commit(self, seq: Sequence, tokens: list[int], logprobs: list[PositionLogprobs] | None) -> None:
        try:
            kept = seq.append_tokens(tokens, self._detokenize, self.max_model_len)
            if logprobs is not None:
                seq.add_logprobs(logprobs[:kept])
        except Exception as exc:  # e.g. a grammar that rejects a committed token: this request alone
            logger.warning("request %s fails alone while committing tokens: %s", seq.request_id, exc)
            seq.fail(f"committing tokens failed: {type(exc).__name__}: {exc}")
            return
        seq.num_computed = seq.num_tokens - 1
        self.stats.generation_tokens += kept

    def _emitted_logprobs(
        self, probs: torch.Tensor, seqs: list[Sequence], tokens: list[list[int]]
    ) -> list[list[PositionLogprobs] | None]:
        """Logprobs of each request's emitted tokens: tokens[b][j] under probs[b, j] ([B, P, V] processed
        target probabilities); None for requests that did not ask."""
        result: list[list[PositionLogprobs] | None] = [None] * len(seqs)
        want = [b for b, s in enumerate(seqs) if s.logprobs is not None and tokens[b]]
        if not want:
            return result
        b_idx = [b for b in want for _ in tokens[b]]
        j_idx = [j for b in want for j in range(len(tokens[b]))]
        device = probs.device
        rows = probs[torch.tensor(b_idx, device=device), torch.tensor(j_idx, device=device)]
        num_top = [seqs[b].params.logprobs for b in b_idx]
        entries = self.logprobs.build(rows, [t for b in want for t in tokens[b]], num_top)  # type: ignore[arg-type]
        start = 0
        for b in want:
            result[b] = entries[start : start + len(tokens[b])]
            start += len(tokens[b])
        return result

    def _prefill(self, chunks: list[tuple[Sequence, int]]) -> list[Sequence]:
        """Prefill chunks in one padded pass (target and draft); sample the first token of every request
        whose prompt is now complete, and return those requests. A preempted request's chunks compute its
        tokens again and sample nothing (its next token is known). Requests that asked for prompt logprobs
        keep the logits of every chunk position not scored yet (the others only the last one's)."""
        rows = [seq.token_ids[seq.num_computed : seq.num_computed + n] for seq, n in chunks]
        tables = [seq.block_table for seq, _ in chunks]
        starts = [seq.num_computed for seq, _ in chunks]
        done = [
            seq.num_computed + n == seq.num_prefill_tokens and not seq.output_token_ids for seq, n in chunks
        ]
        sample = [last and seq.params.max_tokens > 0 for (seq, _), last in zip(chunks, done, strict=True)]
        scored = [
            seq.wants_prompt_logprobs and min(start + n, seq.num_prompt_tokens - 1) > _num_scored(seq)
            for (seq, n), start in zip(chunks, starts, strict=True)
        ]
        if any(scored):
            logits = self._prefill_scoring(chunks, rows, tables, starts, sample, scored)
        else:
            keep = [[n - 1] if s else [] for (_, n), s in zip(chunks, sample, strict=True)]
            logits = self.target.forward(rows, tables, starts, keep, prefill=True)
        if self.drafter is not None:
            self.drafter.prefill([seq for seq, _ in chunks], rows, starts)
        for seq, n in chunks:
            seq.num_computed += n
            self.stats.prompt_tokens += n
            self.blocks.register(seq)  # its full prompt blocks now hold target (and draft) K/V
        finished = [seq for (seq, _), last in zip(chunks, done, strict=True) if last]
        for seq in finished:
            if seq.params.max_tokens == 0 and not seq.is_finished:  # scoring only: nothing generated
                seq.finish("length")
        todo = [seq for (seq, _), s in zip(chunks, sample, strict=True) if s]
        if todo:
            assert logits is not None
            if any(seq.is_finished for seq in todo):  # failed while scoring its prompt
                alive = [b for b, seq in enumerate(todo) if not seq.is_finished]
                logits, todo = logits[alive], [todo[b] for b in alive]
        if todo:
            probs, failed = self.processing.probs(logits, todo, [[]] * len(todo))
            uniform = torch.cat([s.draw_uniforms(1) for s in todo])
            tokens = sample_tokens(probs, [s.params.greedy for s in todo], uniform)
            entries = self._emitted_logprobs(probs.unsqueeze(1), todo, [[t] for t in tokens])
            for b, (seq, token) in enumerate(zip(todo, tokens, strict=True)):
                if b in failed:
                    seq.fail(failed[b])
                else:
                    self._commit(seq, [token], entries[b])
        return finished

    def _prefill_scoring(
        self,
        chunks: list[tuple[Sequence, int]],
        rows: list[list[int]],
        tables: list[list[int]],
        starts: list[int],
        sample: list[bool],
        scored: list[bool],
    ) -> torch.Tensor | None:
        """The prefill pass when some chunks want prompt logprobs: record those, and return the logits of
        the positions that sample a first token (what `forward` with keep returns otherwise)."""
        keep = [
            list(range(n)) if want else ([n - 1] if s else [])
            for (_, n), want, s in zip(chunks, scored, sample, strict=True)
        ]
        hidden = self.target.forward_hidden(rows, tables, starts, keep, prefill=True)
        assert hidden is not None
        sampling_rows, offset = [], 0
        for (seq, n), kept, want, s, start in zip(chunks, keep, scored, sample, starts, strict=True):
            if want:
                # Position p predicts prompt token p + 1; the prompt's last position predicts the output.
                # Positions scored before a preemption are not scored again.
                next_tokens = seq.prompt_token_ids[start + 1 : start + n + 1]
                skip = max(0, _num_scored(seq) - start)
                rows_b = hidden[offset + skip : offset + len(next_tokens)]
                self._score_prompt(seq, rows_b, next_tokens[skip:])
            if s:
                sampling_rows.append(offset + len(kept) - 1)
            offset += len(kept)
        return self.target.logits(hidden[sampling_rows]) if sampling_rows else None

    def _score_prompt(self, seq: Sequence, hidden: torch.Tensor, next_tokens: list[int]) -> None:
        if seq.prompt_logprobs is None:
            seq.prompt_logprobs = [None]  # the first prompt token has no prefix to be predicted from
        try:
            num_top = seq.params.prompt_logprobs
            assert num_top is not None
            seq.prompt_logprobs.extend(
                prompt_logprobs(self.logprobs, hidden, self.target.logits, next_tokens, num_top)
            )
        except Exception as exc:
            logger.warning("request %s fails alone while scoring its prompt: %s", seq.request_id, exc)
            seq.fail(f"computing prompt logprobs failed: {type(exc).__name__}: {exc}")

    def _decode(self, seqs: list[Sequence]) -> None:
        """One decode step for running requests: draft, verify in one target pass, commit, roll back."""
        k = self.k
        # Every request draws the same 2K + 1 numbers per step from its own stream, whatever the batch.
        draws = torch.stack([s.draw_uniforms(2 * k + 1) for s in seqs])
        draft_u, verify_u, sample_u = draws[:, :k], draws[:, k : 2 * k], draws[:, 2 * k]
        tables, starts = [s.block_table for s in seqs], [s.num_computed for s in seqs]
        if self.drafter is None:
            logits = self.target.forward([[s.token_ids[-1]] for s in seqs], tables, starts, [[0]] * len(seqs))
            assert logits is not None
            probs, failed = self.processing.probs(logits, seqs, [[]] * len(seqs))
            tokens = sample_tokens(probs, [s.params.greedy for s in seqs], sample_u)
            entries = self._emitted_logprobs(probs.unsqueeze(1), seqs, [[t] for t in tokens])
            for b, (seq, token) in enumerate(zip(seqs, tokens, strict=True)):
                if b in failed:
                    seq.fail(failed[b])
                else:
                    self._commit(seq, [token], entries[b])
            return

        proposal = self.drafter.propose(seqs, draft_u)
        num_draft = proposal.num_tokens.tolist()
        drafts = [row[:n] for row, n in zip(proposal.token_ids.tolist(), num_draft, strict=True)]
        rows = [[s.token_ids[-1], *drafts[b]] for b, s in enumerate(seqs)]
        logits = self.target.forward(rows, tables, starts, [list(range(n + 1)) for n in num_draft])
        assert logits is not None
        # verify() checks finiteness itself; a failure there is isolated row by row in _verify.
        flat, failed = self.processing.probs(logits, seqs, drafts, check_rows=False)
        target_probs = _to_padded_rows(flat, num_draft, k)
        greedy = torch.tensor([s.params.greedy for s in seqs], dtype=torch.bool)
        accepted, forgiven, final_ids = self._verify(
            seqs, proposal, target_probs, greedy, verify_u, sample_u, failed
        )
        self.drafter.commit(seqs, accepted)
        entries = self._emitted_logprobs(target_probs, seqs, final_ids)

        for b, seq in enumerate(seqs):
            if b in failed:
                seq.fail(failed[b])
                continue
            old_outputs = len(seq.output_token_ids)
            self._record(
                seq, num_draft[b], accepted[b], len(forgiven[b]), [old_outputs + i for i in forgiven[b]]
            )
            self._commit(seq, final_ids[b], entries[b])
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
        failed: dict[int, str],
    ) -> tuple[list[int], list[list[int]], list[list[int]]]:
        """verify() for all rows not in `failed`, in one call. With a lossy policy each row has its
        lossless prefix: max(0, L - tokens generated so far), or all of its drafts for a request with
        verification="standard" (which makes its row exactly standard verification). If the call raises,
        the rows are verified one at a time (each row's result does not depend on the others) and the rows
        that still raise join `failed`. Returns per-row accepted counts, forgiven draft positions and the
        tokens to commit (0, [] and [] for failed rows)."""
        accepted = [0] * len(seqs)
        forgiven: list[list[int]] = [[] for _ in seqs]
        final_ids: list[list[int]] = [[] for _ in seqs]
        idx = [b for b in range(len(seqs)) if b not in failed]
        if not idx:
            return accepted, forgiven, final_ids
        prefix = self._lossless_before(seqs)
        args = (proposal, target_probs, greedy, verify_u, sample_u, prefix)
        try:
            # The usual case is all rows: then no copies of the [B, K+1, V] probabilities.
            results = self._verify_rows(None if len(idx) == len(seqs) else idx, idx, *args)
        except Exception:
            results = []
            for b in idx:
                try:
                    results.extend(self._verify_rows([b], [b], *args))
                except Exception as exc:
                    failed[b] = (
                        non_finite_message(seqs[b].params)
                        if not bool(torch.isfinite(target_probs[b].sum()))
                        else f"verification failed: {type(exc).__name__}: {exc}"
                    )
                    logger.warning("request %s fails alone: %s", seqs[b].request_id, failed[b])
        for b, num_accepted, forgiven_b, ids_b in results:
            accepted[b], forgiven[b], final_ids[b] = num_accepted, forgiven_b, ids_b
        return accepted, forgiven, final_ids

    def _lossless_before(self, seqs: list[Sequence]) -> torch.Tensor | None:
        """[B] lossless prefix per row for a lossy policy (None when no row has one)."""
        if self.policy is None:
            return None
        everything = self.k + 1  # covers every draft position: the row is verified as standard
        prefix = [
            everything
            if s.params.verification == "standard"
            else max(0, self.lossless_prefix_tokens - len(s.output_token_ids))
            for s in seqs
        ]
        return torch.tensor(prefix, dtype=torch.int64) if any(prefix) else None

    def _verify_rows(
        self,
        sel: list[int] | None,
        idx: list[int],
        proposal: Proposal,
        target_probs: torch.Tensor,
        greedy: torch.Tensor,
        verify_u: torch.Tensor,
        sample_u: torch.Tensor,
        prefix: torch.Tensor | None,
    ) -> list[tuple[int, int, list[int], list[int]]]:
        """(row, accepted, forgiven positions, tokens to commit) for the rows `sel` (None = all, = idx)."""
        with self._verify_timer:
            out = verify(
                _rows(proposal.token_ids, sel),
                _rows(target_probs, sel),
                None if proposal.probs is None else _rows(proposal.probs, sel),
                greedy=_rows(greedy, sel),
                policy=self.policy,
                lossless_before=None if prefix is None else _rows(prefix, sel),
                num_draft_tokens=_rows(proposal.num_tokens, sel),
                uniform=_rows(verify_u, sel),
                sample_uniform=_rows(sample_u, sel),
            )
        num_accepted, token_ids = out.num_accepted.tolist(), out.token_ids.tolist()
        forgiven_mask = out.forgiven.tolist()
        return [
            (
                b,
                num_accepted[j],
                [i for i, f in enumerate(forgiven_mask[j]) if f],
                token_ids[j][: num_accepted[j] + 1],
            )
            for j, b in enumerate(idx)
        ]

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


def _num_scored(seq: Sequence) -> int:
    """Prompt positions whose logprobs the request has (position p predicts prompt token p + 1)."""
    return 0 if seq.prompt_logprobs is None else len(seq.prompt_logprobs) - 1


def _kv_cache_blocks(
    requested: int | None, bytes_per_token: int, max_len: int, max_running: int, device: torch.device
) -> int:
    """KV cache blocks for kv_cache_memory_bytes=requested (None: DEFAULT_KV_CACHE_SHARE's rule); at
    least one request of max_len positions must fit."""
    block_bytes = BLOCK_SIZE * bytes_per_token
    per_request = -(-max_len // BLOCK_SIZE)
    if requested is None:
        if device.type == "cuda":
            available = torch.cuda.mem_get_info(device)[0]
        else:
            available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        share = int(available * DEFAULT_KV_CACHE_SHARE) // block_bytes
        return max(per_request, min(max_running * per_request, share))
    if device.type == "cpu" and requested > os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"):
        logger.warning(
            "kv_cache_memory_bytes=%d is more than this machine's memory: requests may exhaust it before "
            "the cap stops them",
            requested,
        )
    if requested // block_bytes < per_request:
        raise ValueError(
            f"kv_cache_memory_bytes={requested} holds {requested // block_bytes * BLOCK_SIZE} positions, but "
            f"one request of max_model_len needs {max_len} ({bytes_per_token} bytes per position, in blocks "
            f"of {BLOCK_SIZE}); raise kv_cache_memory_bytes to at least {per_request * block_bytes} or lower "
            "max_model_len"
        )
    return requested // block_bytes


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


def _weight_format(loaded: LoadedModel) -> str:
    """How a model's linear layers hold their weights, e.g. "int8", "bfloat16 (prepacked)", "float32"."""
    if loaded.quantization is not None:
        return loaded.quantization
    dtype = str(loaded.dtype).removeprefix("torch.")
    return f"{dtype} (prepacked)" if loaded.model.packed else dtype


def _check_quantized_as_configured(role: str, loaded: LoadedModel, quantization: str | None) -> None:
    # A preloaded model (the benchmarks share weights across engines) must be what the config says;
    # "auto" accepts whatever the load chose.
    if quantization != "auto" and loaded.quantization != quantization:
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
