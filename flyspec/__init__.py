"""flyspec: fast and safe speculative decoding.

`from flyspec import LLM, SamplingParams, SpeculativeConfig, RequestOutput`. The names load on first use
(PEP 562), so importing the package (e.g. for `flyspec --help`) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flyspec.config import EngineConfig, SpeculativeConfig
    from flyspec.llm import LLM
    from flyspec.outputs import CompletionOutput, RequestOutput
    from flyspec.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "RequestOutput",
    "SamplingParams",
    "SpeculativeConfig",
    "StructuredOutputsParams",
]

_HOMES = {
    "LLM": "flyspec.llm",
    "SamplingParams": "flyspec.sampling_params",
    "StructuredOutputsParams": "flyspec.sampling_params",
    "SpeculativeConfig": "flyspec.config",
    "EngineConfig": "flyspec.config",
    "RequestOutput": "flyspec.outputs",
    "CompletionOutput": "flyspec.outputs",
}


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'flyspec' has no attribute {name!r}")
