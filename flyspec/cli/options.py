"""Options several commands share, so they are spelled, documented and parsed the same way everywhere."""

from __future__ import annotations

import json
import re
from typing import Annotated, Any

import typer
from typer.core import TyperCommand, TyperGroup

HELP_MARKUP = "markdown"
"""How `--help` renders docstrings and option help. Typer's "rich" mode keeps every line break after a
command's first paragraph, so source-wrapped docstrings broke mid-sentence at any terminal width; markdown
joins the lines of a paragraph and wraps them to the terminal."""


class _FlagsTakeNoValue:
    """A flag takes no value, so `--help` shows none for it. Typer 0.29's rich help panel prints each
    option's type, flags included (`--json <bool>`, even `--help <bool>`), unless the option has a
    metavar; a flag's metavar is therefore empty. Set on every parameter the command has, `--help` too."""

    def get_params(self, ctx: Any) -> list[Any]:
        params = super().get_params(ctx)  # type: ignore[misc]
        for param in params:
            if getattr(param, "is_flag", False) and param.metavar is None:
                param.metavar = ""
        return params


class _Command(_FlagsTakeNoValue, TyperCommand):
    pass


class _Group(_FlagsTakeNoValue, TyperGroup):
    pass


class App(typer.Typer):
    """Every `flyspec` command group: typer's, with the help rendering above (HELP_MARKUP, flags shown
    as flags) for the group and for each command it declares."""

    def __init__(self, **settings: Any) -> None:
        super().__init__(cls=_Group, rich_markup_mode=HELP_MARKUP, **settings)

    def command(self, *args: Any, **settings: Any) -> Any:
        return super().command(*args, cls=_Command, **settings)


def opt(help_text: str) -> Any:
    """A typer option with only its help text (its name is the parameter's)."""
    return typer.Option(help=help_text)


SpeculativeConfigOption = Annotated[
    str | None,
    typer.Option(
        "--speculative-config",
        help='Speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' or '
        '\'{"model": "DRAFT", "num_speculative_tokens": 4, "rejection_sample_method": "fly"}\'.',
    ),
]

_QUANTIZATION_HELP = (
    "Weight quantization at load time: auto (each format's matmuls timed against bfloat16 on this CPU and "
    "the model's shapes at load, about a second, cached; the fastest wins, or none), int8 (per-channel "
    "int8 weights, per-token int8 activations), int4 (4-bit weights in groups of 64, int8 activations) "
    "or none. CPU only; the draft model too unless --speculative-config sets its quantization."
)
QuantizationOption = Annotated[str | None, typer.Option(help=_QUANTIZATION_HELP + " Default: none.")]
AutoQuantizationOption = Annotated[str, typer.Option(help=_QUANTIZATION_HELP + " Default: auto.")]

KvCacheMemoryOption = Annotated[
    str | None,
    typer.Option(
        "--kv-cache-memory-bytes",
        help="Cap on the KV cache of the target and draft together, in bytes or with a unit (4GiB, 512M). "
        "Requests beyond it wait, or the newest is preempted and computed again later. Default: what "
        "max-num-seqs requests of max-model-len need, at most a quarter of the machine's memory.",
    ),
]

PrefixCachingOption = Annotated[
    bool,
    typer.Option(
        "--enable-prefix-caching/--no-enable-prefix-caching",
        help="Share the KV blocks of identical prompt prefixes between requests (their prefill is saved).",
    ),
]

BatchInvariantOption = Annotated[
    bool,
    typer.Option(
        "--batch-invariant",
        help="Compute each request the same way whatever else is in the batch, so its output does not "
        "depend on other requests (slower; refused where this machine's kernels cannot do it).",
    ),
]

JsonFlag = Annotated[bool, typer.Option("--json", help="End stdout with one JSON object.")]

_MEMORY = re.compile(r"(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)b?", re.IGNORECASE)


def parse_speculative_config(text: str | None) -> dict[str, Any] | None:
    """The --speculative-config JSON as a dict (None when absent); ValueError names what is wrong.

    Only the JSON is checked here: the config's own rules are SpeculativeConfig's, applied when the
    engine configuration is built.
    """
    if text is None or not text.strip():
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--speculative-config is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"--speculative-config must be a JSON object, got {type(value).__name__}")
    return value


def parse_quantization(text: str | None) -> str | None:
    """--quantization as EngineConfig takes it: None for absent or 'none' (the value itself is checked by
    EngineConfig)."""
    if text is None or text.strip().lower() == "none":
        return None
    return text.strip()


def parse_memory_bytes(text: str | None, option: str = "--kv-cache-memory-bytes") -> int | None:
    """A byte count from '4294967296', '4GiB', '4G', '512MB' or '1.5g' (k, m, g, t: powers of 1000 with a
    plain or B suffix, of 1024 with iB, as vLLM reads them); None when absent."""
    if text is None:
        return None
    match = _MEMORY.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"{option}={text!r} is invalid: give bytes, e.g. 4294967296, 4GiB or 512M")
    number, unit, binary = match.groups()
    power = "kmgt".find(unit.lower()) + 1 if unit else 0
    value = float(number) * (1024 if binary else 1000) ** power
    if value < 1:
        raise ValueError(f"{option}={text!r} is invalid: it must be at least one byte")
    return int(value)
