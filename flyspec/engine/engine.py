"""The engine's step loop: schedule -> prefill chunks -> draft -> target verify -> verify() -> commit.

KV memory: the target (and a draft model) keep keys and values in a paged cache whose blocks the
scheduler hands out as requests grow and takes back when they end (engine/kv_blocks.py), within
`kv_cache_memory_bytes`; identical prompt blocks are shared (prefix caching). Building the models, the
cache and the drafter is engine/build.py's job; this file only runs steps.

Target cache invariant (its length lives on each Sequence as `num_computed`; the cache never tracks
it): after a request's prompt is in, `num_computed == num_tokens - 1`; each decode step feeds the newest
token plus K_b draft tokens at position `num_computed`, and afterwards keeps the newest token and the `a`
accepted drafts, so the invariant holds again (rejected positions are simply overwritten). The drafter
owns its own draft-side lengths behind the `Drafter` interface (engine/drafters/base.py): the engine
tells it what the target prefilled and what verification kept, and never asks which drafter it is.

Who decodes a request (SamplingParams.verification): by default the drafter proposes and the target
verifies; "target_only" requests get no drafts (one target token per step, sampled exactly as without
speculation); "draft_only" requests are answered by a drafter that `answers_alone` (a draft model of the
target's vocabulary): its K drafts per step are the output, and the target never runs for them (their
`num_computed` counts the draft's positions in their blocks). With `disable_by_batch_size`, a step with
that many running requests drafts for nobody (draft-only requests excepted). Without a speculative
config every request decodes one target token per step.

Logits processing (penalties, logit bias, grammar masks; engine/logits_processing.py) and logprobs
(engine/logprobs.py) cost nothing for requests that do not use them. A request whose processing,
verification or commit raises (or whose distribution is not finite) fails alone with finish_reason
"error": its KV blocks are freed and the other requests' outputs are exactly what they would be without it.

Exactness: in float32, greedy speculative output is token-identical to target-only greedy output. In
bfloat16 the (1 + K)-token verify pass may round differently from one-token decoding, so at rare
near-ties the two can pick different tokens; that is expected (docs/verification.md), not a bug.
"""

from __future__ import annotations

import logging

import torch

from flyspec.config import EngineConfig
from flyspec.engine.build import build_parts
from flyspec.engine.drafters.base import Proposal
from flyspec.engine.logits_processing import RequestLogitsState, TargetProcessing
from flyspec.engine.logprobs import LogprobsBuilder
from flyspec.engine.model_runner import sample_tokens
from flyspec.engine.prompt_scoring import prefill_scoring, wants_scoring
from flyspec.engine.scheduler import Scheduler
from flyspec.engine.sequence import RequestGroup, Sequence
from flyspec.engine.step_buffer import StepBuffer
from flyspec.engine.structured import Grammars
from flyspec.engine.timing import StepTiming
from flyspec.engine.verify_batch import RowResult, VerifyBatch, verify_isolated
from flyspec.engine.warmup import WARMUP_TIME_LIMIT_S, WARMUP_TOKENS, warm_up
from flyspec.models.loader import LoadedModel
from flyspec.outputs import PositionLogprobs, RequestOutput
from flyspec.sampling_params import DRAFT_ONLY, SPECULATION_MODES, TARGET_ONLY, SamplingParams

logger = logging.getLogger("flyspec.engine")


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
        parts = build_parts(config, target=target, draft=draft)
        self.capacity = parts.capacity
        self.tokenizer = parts.tokenizer
        self.max_model_len = parts.max_model_len
        self.vocab_size = parts.vocab_size
        self.eos_token_ids = parts.eos_token_ids
        self.stats = parts.stats
        self.weight_formats = parts.weight_formats
        self.blocks = parts.blocks
        self._kv_block_bytes = parts.kv_block_bytes
        self.target = parts.target
        self.drafter = parts.drafter
        self.policy = parts.policy
        self.lossless_prefix_tokens = parts.lossless_prefix_tokens
        self.disable_by_batch_size = spec.disable_by_batch_size if spec is not None else None
        self._clock = parts.clock
        self._verify_timer = self._clock.part("verify_s")
        self.scheduler = Scheduler(
            config.max_num_batched_tokens, self.capacity.max_running, 1 + self.k, self.blocks
        )
        self.grammars = Grammars(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self.processing = TargetProcessing(self.grammars)
        # The decode step's processed target probabilities, in one buffer reused step after step (the
        # logits have their own, in the target's ModelRunner; engine/step_buffer.py says why).
        self._probs_buffer = StepBuffer(self.vocab_size, torch.float32, self.target.device)
        self.logprobs = LogprobsBuilder(self.tokenizer)
        self._requests: dict[str, RequestGroup] = {}
        self._seqs: dict[str, Sequence] = {}  # every unfinished sample, by its own (unique) id
        self._num_added = 0

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
        """Bytes of KV cache the engine may use (target and draft together), in whole blocks, as the
        config sized it (engine/build.py). On the CPU only the blocks ever written are resident."""
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
        self._check_verification(params.verification)
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
            self._release_draft(seq)
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

    # ------------------------------------------------------------------ requests

    def _check_verification(self, wanted: str | None) -> None:
        """ValueError unless this engine can decode a request the way `verification=wanted` asks."""
        if wanted == DRAFT_ONLY and (self.drafter is None or not self.drafter.answers_alone):
            has = "no speculative config" if self.drafter is None else f"a {type(self.drafter).__name__}"
            raise ValueError(
                "verification='draft_only' needs an engine whose speculative_config has a draft model of the "
                f"target's vocabulary (method='draft_model'); this engine has {has}"
            )
        if wanted in (None, "standard", *SPECULATION_MODES):
            return
        if self.policy is None or wanted != self.policy.name:
            running = "standard" if self.policy is None else self.policy.name
            raise ValueError(
                f"verification={wanted!r} needs an engine started with speculative_config "
                f"rejection_sample_method={wanted!r}; this engine verifies with {running!r}"
            )

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

    def _update_usage(self) -> None:
        self.stats.kv_cache_usage = self.blocks.num_used_blocks / self.blocks.num_blocks

    def _release_draft(self, seq: Sequence) -> None:
        if self.drafter is not None:
            self.drafter.release(seq)

    def _release(self, seq: Sequence) -> None:
        self._seqs.pop(seq.request_id, None)
        self._release_draft(seq)

    def _abort(self, group: RequestGroup) -> None:
        for seq in group.seqs:
            if self.scheduler.abort(seq.request_id) is not None:
                if not seq.is_finished:
                    seq.finish("abort")
                self._release(seq)

    # ------------------------------------------------------------------ the step

    def _prefill(self, chunks: list[tuple[Sequence, int]]) -> list[Sequence]:
        """Prefill chunks in one target pass and one draft pass, and sample the first token of every
        request whose prompt is now complete (from the model that answers it); return those requests. The
        target takes every chunk but draft-only ones; the drafter takes every chunk but target-only ones
        whose blocks nobody will share. A preempted request's chunks compute its tokens again and sample
        nothing (its next token is known)."""
        seqs = [seq for seq, _ in chunks]
        starts = [seq.num_computed for seq in seqs]
        rows = [seq.token_ids[start : start + n] for (seq, n), start in zip(chunks, starts, strict=True)]
        done = [
            start + n == seq.num_prefill_tokens and not seq.output_token_ids
            for (seq, n), start in zip(chunks, starts, strict=True)
        ]
        sample = [d and s.params.max_tokens > 0 for s, d in zip(seqs, done, strict=True)]
        by_target = [b for b, s in enumerate(seqs) if not s.params.answered_by_draft]
        target_logits = self._target_prefill([chunks[b] for b in by_target], [sample[b] for b in by_target])
        draft_logits = self._draft_prefill(chunks, rows, starts, sample)
        for seq, n in chunks:
            seq.num_computed += n
            self.stats.prompt_tokens += n
            self.blocks.register(seq)  # its full prompt blocks now hold target and draft K/V
        for seq, d in zip(seqs, done, strict=True):
            if d and seq.params.max_tokens == 0 and not seq.is_finished:  # scoring only: nothing generated
                seq.finish("length")
        # Target-answered requests first, then draft-answered ones: the order of the two logits blocks.
        todo = [seqs[b] for b in by_target if sample[b]]
        todo += [s for s, want in zip(seqs, sample, strict=True) if want and s.params.answered_by_draft]
        logits = torch.cat((target_logits, draft_logits.to(target_logits.device)))
        alive = [b for b, seq in enumerate(todo) if not seq.is_finished]  # not failed scoring its prompt
        if len(alive) < len(todo):
            logits, todo = logits[alive], [todo[b] for b in alive]
        if todo:
            self._sample_and_commit(todo, logits, torch.cat([s.draw_uniforms(1) for s in todo]))
        return [seq for seq, d in zip(seqs, done, strict=True) if d]

    def _target_prefill(self, chunks: list[tuple[Sequence, int]], sample: list[bool]) -> torch.Tensor:
        """The target's prefill pass over `chunks`; the logits of the chunks that sample, in order."""
        if not chunks:
            return torch.empty((0, self.vocab_size))
        rows = [seq.token_ids[seq.num_computed : seq.num_computed + n] for seq, n in chunks]
        starts = [seq.num_computed for seq, _ in chunks]
        scored = [wants_scoring(seq, start, n) for (seq, n), start in zip(chunks, starts, strict=True)]
        if any(scored):
            return prefill_scoring(self.target, self.logprobs, chunks, rows, starts, sample, scored)
        keep = [[n - 1] if s else [] for (_, n), s in zip(chunks, sample, strict=True)]
        tables = [seq.block_table for seq, _ in chunks]
        return self.target.forward(rows, tables, starts, keep, prefill=True)

    def _draft_prefill(
        self, chunks: list[tuple[Sequence, int]], rows: list[list[int]], starts: list[int], sample: list[bool]
    ) -> torch.Tensor:
        """The drafter's prefill pass; the draft logits of the draft-only chunks that sample, in order."""
        empty = torch.empty((0, self.vocab_size))
        if self.drafter is None:
            return empty
        # A target-only request's blocks need the draft's K/V only if another request may share them.
        take = [
            b
            for b, (seq, _) in enumerate(chunks)
            if seq.params.verification != TARGET_ONLY or self.blocks.registers(seq)
        ]
        if not take:
            return empty
        seqs, rows, starts = [chunks[b][0] for b in take], [rows[b] for b in take], [starts[b] for b in take]
        if not any(s.params.answered_by_draft for s in seqs):
            self.drafter.prefill(seqs, rows, starts)
            return empty
        keep = [
            [len(row) - 1] if sample[b] and s.params.answered_by_draft else []
            for b, s, row in zip(take, seqs, rows, strict=True)
        ]
        return self.drafter.answer_prefill(seqs, rows, starts, keep)

    def _decode(self, seqs: list[Sequence]) -> None:
        """One decode step: the drafter proposes for the requests that speculate this step and for the
        draft-only ones, one target pass scores the newest token (plus drafts) of every other request,
        then verification or plain sampling, and the commits."""
        k, drafter = self.k, self.drafter
        drafting = self._drafting_now()
        spec = [s for s in seqs if drafting and s.params.may_draft]
        plain = [s for s in seqs if not s.params.answered_by_draft and not (drafting and s.params.may_draft)]
        alone = [s for s in seqs if s.params.answered_by_draft]
        # Each request draws the same numbers per step from its own stream, whatever the batch: 2K + 1 when
        # it speculates, K when the draft answers it, 1 when it decodes one token (as without a drafter).
        spec_u, alone_u, plain_u = _uniforms(spec, 2 * k + 1), _uniforms(alone, k), _uniforms(plain, 1)
        proposal = Proposal.empty(k)
        if drafter is not None and (spec or alone):
            proposal = drafter.propose(spec + alone, torch.cat((spec_u[:, :k], alone_u)))
        spec_proposal, alone_proposal = proposal.rows(0, len(spec)), proposal.rows(len(spec), None)
        num_draft = spec_proposal.num_tokens.tolist()
        drafts = [row[:n] for row, n in zip(spec_proposal.token_ids.tolist(), num_draft, strict=True)]
        targets = spec + plain
        rows = [[s.token_ids[-1], *d] for s, d in zip(spec, drafts, strict=True)]
        rows += [[s.token_ids[-1]] for s in plain]
        logits = torch.empty((0, self.vocab_size))
        if targets:
            tables, starts = [s.block_table for s in targets], [s.num_computed for s in targets]
            keep = [list(range(len(r))) for r in rows]
            logits = self.target.forward(rows, tables, starts, keep, reuse=True)
        probs = self._probs_buffer.rows(len(logits))
        split = sum(n + 1 for n in num_draft)
        accepted = self._verify_and_commit(
            spec, spec_proposal, drafts, logits[:split], spec_u[:, k:], probs[:split]
        )
        self._sample_and_commit(plain, logits[split:], plain_u[:, 0], probs[split:])
        for seq, tokens in zip(alone, alone_proposal.token_ids.tolist(), strict=True):
            self._commit(seq, tokens, None)  # every draft kept: nothing was verified, nothing is counted
        if drafter is not None and (spec or alone):
            drafter.commit(spec + alone, accepted + [k] * len(alone))

    def _drafting_now(self) -> bool:
        """Whether requests speculate this step: a drafter, and fewer running requests than
        disable_by_batch_size (vLLM's rule: at or past it, speculation costs more than it saves)."""
        limit = self.disable_by_batch_size
        return self.drafter is not None and (limit is None or self.scheduler.num_running < limit)

    def _verify_and_commit(
        self,
        seqs: list[Sequence],
        proposal: Proposal,
        drafts: list[list[int]],
        logits: torch.Tensor,
        uniform: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> list[int]:
        """Verify the drafts of `seqs` against the target's logits (rows of K_b + 1 positions each) with
        their uniforms [B, K + 1] (the p/q tests, then the recovered or bonus token), commit what each row
        keeps, count it, and return the number of drafts each row kept. `out`: a buffer for the
        processed probabilities, as for `TargetProcessing.probs`."""
        if not seqs:
            return []
        k = self.k
        num_draft = [len(d) for d in drafts]
        # verify() checks finiteness itself; a failure there is isolated row by row.
        flat, failed = self.processing.probs(logits, seqs, drafts, check_rows=False, out=out)
        batch = VerifyBatch(
            draft_token_ids=proposal.token_ids,
            num_draft_tokens=proposal.num_tokens,
            draft_probs=proposal.probs,
            target_probs=_to_padded_rows(flat, num_draft, k),
            greedy=torch.tensor([s.params.greedy for s in seqs], dtype=torch.bool),
            uniform=uniform[:, :k],
            sample_uniform=uniform[:, k],
            lossless_before=self._lossless_before(seqs),
        )
        results = verify_isolated(batch, self.policy, seqs, failed, self._verify_timer)
        kept = [results[b].token_ids if b in results else [] for b in range(len(seqs))]
        entries = self.logprobs.emitted(batch.target_probs, seqs, kept)
        for b, seq in enumerate(seqs):
            if b in failed:
                seq.fail(failed[b])
                continue
            self._record(seq, num_draft[b], results[b])
            self._commit(seq, kept[b], entries[b])
            # A stop condition may have cut the step's tokens short; forget forgiven positions past it.
            seq.metrics.forgiven_positions = [
                i for i in seq.metrics.forgiven_positions if i < len(seq.output_token_ids)
            ]
        return [results[b].num_accepted if b in results else 0 for b in range(len(seqs))]

    def _sample_and_commit(
        self,
        seqs: list[Sequence],
        logits: torch.Tensor,
        uniform: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> None:
        """Sample one token per request from its row of `logits` [B, V] (processed as the request asks)
        with its uniform [B], and commit it: every token that is not the outcome of verification (the
        first token after a prompt, and decode steps without drafts). `out`: a buffer for the processed
        probabilities, as for `TargetProcessing.probs`."""
        if not seqs:
            return
        probs, failed = self.processing.probs(logits, seqs, [[]] * len(seqs), out=out)
        tokens = sample_tokens(probs, [s.params.greedy for s in seqs], uniform)
        entries = self.logprobs.emitted(probs.unsqueeze(1), seqs, [[t] for t in tokens])
        for b, (seq, token) in enumerate(zip(seqs, tokens, strict=True)):
            if b in failed:
                seq.fail(failed[b])
            else:
                self._commit(seq, [token], entries[b])

    def _lossless_before(self, seqs: list[Sequence]) -> torch.Tensor | None:
        """[B] lossless prefix per row for a lossy policy (None when no row has one): max(0, L - tokens
        generated so far), or every draft position for a request with verification="standard" (which
        makes its row exactly standard verification)."""
        if self.policy is None:
            return None
        everything = self.k + 1
        prefix = [
            everything
            if s.params.verification == "standard"
            else max(0, self.lossless_prefix_tokens - len(s.output_token_ids))
            for s in seqs
        ]
        return torch.tensor(prefix, dtype=torch.int64) if any(prefix) else None

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

    def _detokenize(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def _record(self, seq: Sequence, num_draft: int, result: RowResult) -> None:
        forgiven = len(result.forgiven)
        self.stats.record_verification(num_draft, result.num_accepted, forgiven)
        if num_draft == 0:
            return
        m = seq.metrics
        first = len(seq.output_token_ids)  # the row's tokens are committed after this
        m.num_drafts += 1
        m.num_draft_tokens += num_draft
        m.num_accepted_tokens += result.num_accepted
        m.num_forgiven_tokens += forgiven
        m.forgiven_positions.extend(first + i for i in result.forgiven)


def _uniforms(seqs: list[Sequence], n: int) -> torch.Tensor:
    """[B, n] float64 numbers in (0, 1), row b from request b's own stream."""
    if not seqs:
        return torch.empty((0, n), dtype=torch.float64)
    return torch.stack([s.draw_uniforms(n) for s in seqs])


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
