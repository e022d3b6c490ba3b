"""flyspec: fast and safe speculative decoding.

`from flyspec import LLM, SamplingParams, SpeculativeConfig, RequestOutput`. The names load on first use
(PEP 562), so importing the package (e.g. for `flyspec --help`) does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flyspec.lazy import lazy_attributes

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


__getattr__ = lazy_attributes(__name__, _HOMES)
