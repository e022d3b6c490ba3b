"""How far quantized weights move a model's predictions: the quality table of docs/performance.md.

For each model and format: greedy answers of the unquantized model to the first GSM8K chat prompts, then
both models scored on those answers position by position, the prompt in a prefill pass as in the engine
(teacher-forced top-1 agreement, KL divergence
of the quantized next-token distribution from the unquantized one, mean absolute logit error), and the
quantized model's own free-running greedy answers compared with the unquantized ones.

    python scripts/quant_quality.py --formats int8,int4 --prompts 16 --max-tokens 96
"""

from __future__ import annotations

import argparse

import torch

from flyspec import LLM, SamplingParams
from flyspec.bench.prompts import load_prompts
from flyspec.models.llama import ForwardBatch
from flyspec.models.loader import load_model


def _answer_logits(loaded, prompt: list[int], answer: list[int]) -> torch.Tensor:
    """Logits predicting each answer token, computed as the engine does: the prompt in a prefill pass
    (int4 layers use their int8 copy there), then the answer tokens in a pass of their own."""
    model = loaded.model
    cache = model.new_cache(1, len(prompt) + len(answer))
    first = ForwardBatch(torch.tensor([0]), torch.tensor([0]), torch.tensor([len(prompt)]), prefill=True)
    last = model(torch.tensor([prompt]), first, cache)[0, -1:]
    rest = ForwardBatch(torch.tensor([0]), torch.tensor([len(prompt)]), torch.tensor([len(answer) - 1]))
    hidden = model(torch.tensor([answer[:-1]]), rest, cache)[0]
    return model.compute_logits(torch.cat((last, hidden))).float()


def _answers(model: str, quantization: str | None, prompts, max_tokens: int) -> list[list[int]]:
    llm = LLM(model, quantization=quantization, max_num_seqs=len(prompts))
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([p.token_ids for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _shared_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--models", default="qwen2.5-coder-1.5b-instruct,qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--formats", default="int8,int4")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()
    print(
        "| model | format | teacher-forced top-1 agreement | KL per token (nats) | mean abs logit error "
        "| outputs identical / shared prefix (free-running) |"
    )
    print("|---|---|---:|---:|---:|---:|")
    for name in args.models.split(","):
        ref = load_model(name)
        prompts = load_prompts("gsm8k", args.prompts, ref.tokenizer)
        base = _answers(name, None, prompts, args.max_tokens)
        for fmt in args.formats.split(","):
            quant = load_model(name, quantization=fmt)
            agree = kl = err = 0.0
            count = 0
            with torch.inference_mode():
                for prompt, answer in zip(prompts, base, strict=True):
                    a = _answer_logits(ref, prompt.token_ids, answer)
                    b = _answer_logits(quant, prompt.token_ids, answer)
                    agree += (a.argmax(-1) == b.argmax(-1)).sum().item()
                    kl += (a.log_softmax(-1).exp() * (a.log_softmax(-1) - b.log_softmax(-1))).sum().item()
                    err += (a - b).abs().mean(-1).sum().item()
                    count += len(answer)
            del quant
            free = _answers(name, fmt, prompts, args.max_tokens)
            same = sum(f == g for f, g in zip(free, base, strict=True))
            prefix = sum(_shared_prefix(f, g) for f, g in zip(free, base, strict=True)) / count
            print(
                f"| {name} | {fmt} | {agree / count:.1%} | {kl / count:.4f} | {err / count:.2f} "
                f"| {same} of {len(base)} / {prefix:.0%} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
