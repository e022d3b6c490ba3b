"""The offline API (SPEC 3.1): `LLM(...).generate(prompts, sampling_params)`, mirroring vLLM's."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from flyspec.config import EngineConfig, SpeculativeConfig
from flyspec.engine.engine import LLMEngine
from flyspec.outputs import RequestOutput
from flyspec.sampling_params import SamplingParams

Prompt = str | list[int]
Message = dict[str, Any]


class LLM:
    """A target model (optionally with a drafter) for batched offline generation.

    model: an HF folder, a .gguf file, or a zoo name. speculative_config: a dict or SpeculativeConfig
    (None = no speculation). max_model_len None = min(the model's max_position_embeddings, 4096).
    """

    def __init__(
        self,
        model: str,
        speculative_config: SpeculativeConfig | dict[str, Any] | None = None,
        dtype: str = "auto",
        device: str = "cpu",
        max_num_seqs: int = 16,
        max_num_batched_tokens: int = 2048,
        max_model_len: int | None = None,
        seed: int = 0,
    ) -> None:
        config = EngineConfig(
            model=model,
            speculative_config=speculative_config,
            dtype=dtype,
            device=device,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            seed=seed,
        )
        self.engine = LLMEngine(config)
        self._ids = itertools.count()

    def get_tokenizer(self) -> Any:
        """The target model's tokenizer."""
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for a prompt or a list of prompts (text or token ids); outputs in prompt order.

        sampling_params: one for all prompts, one per prompt, or None (SamplingParams() defaults).
        use_tqdm: show a progress bar (rich) of finished requests.
        """
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        return self._run(list(prompts), sampling_params, [None] * len(prompts), use_tqdm)  # type: ignore[arg-type]

    def chat(
        self,
        messages: list[Message] | Seq[list[Message]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, applying the tokenizer's chat template
        (with the assistant turn opened, add_generation_prompt=True)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.get_tokenizer()
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("the model's tokenizer has no chat template; use generate() with plain prompts")
        texts = [
            tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True)
            for c in conversations
        ]
        # The template already holds any special tokens (BOS included), so tokenise without adding more.
        ids = [tokenizer(t, add_special_tokens=False).input_ids for t in texts]
        return self._run(ids, sampling_params, texts, use_tqdm)

    def _run(
        self,
        prompts: list[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None,
        texts: list[str | None],
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        if sampling_params is None:
            params = [SamplingParams()] * len(prompts)
        elif isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(
                    f"got {len(params)} sampling_params for {len(prompts)} prompts; "
                    "pass one, or one per prompt"
                )
        engine = self.engine
        request_ids = [f"llm-{next(self._ids)}" for _ in prompts]
        added: list[str] = []
        try:
            for request_id, prompt, p, text in zip(request_ids, prompts, params, texts, strict=True):
                engine.add_request(request_id, prompt, p, prompt_text=text)
                added.append(request_id)
        except ValueError as exc:
            for request_id in added:
                engine.abort_request(request_id)
            raise ValueError(f"prompt {len(added)}: {exc}") from exc

        final: dict[str, RequestOutput] = {}
        with Progress(
            TextColumn("generating"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[speed]}"),
            console=Console(stderr=True),  # stdout stays clean for results (`--json` last lines)
            disable=not use_tqdm,
            transient=True,
        ) as progress:
            task = progress.add_task("generate", total=len(prompts), speed="")
            generated = 0
            try:
                while len(final) < len(prompts):
                    for out in engine.step():
                        if out.finished:
                            final[out.request_id] = out
                            generated += len(out.outputs[0].token_ids)
                    elapsed = progress.tasks[0].elapsed or 0.0
                    speed = f"{generated / elapsed:.1f} tok/s" if elapsed > 0 else ""
                    progress.update(task, completed=len(final), speed=speed)
            except BaseException:
                # Leave the engine clean for the next call (e.g. after Ctrl-C).
                for request_id in request_ids:
                    engine.abort_request(request_id)
                raise
        return [final[request_id] for request_id in request_ids]
