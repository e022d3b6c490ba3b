"""Options several commands share, so they are spelled, documented and parsed the same way everywhere."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer


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

JsonFlag = Annotated[bool, typer.Option("--json", help="End stdout with one JSON object.")]


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
