"""What the server needs of the engine it drives: one typed contract instead of `Any`.

`LLMEngine` satisfies it (tests/test_server_protocol.py checks it). The server thread that owns the engine
(`engine_loop.py`) adds, steps and aborts requests; the request handlers read the engine's fixed facts
(vocabulary, context length, tokenizer, grammar compiler, admission cap) once at start-up and its live
counters for /metrics. Nothing else of the engine is touched, so another engine that keeps this contract
can be served as it is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from flyspec.config import EngineConfig
    from flyspec.engine.structured import Grammars
    from flyspec.outputs import RequestOutput
    from flyspec.sampling_params import SamplingParams
    from flyspec.spec_decode.metrics import SpecDecodeStats


@runtime_checkable
class ServedEngine(Protocol):
    """The engine as the server uses it."""

    config: EngineConfig
    vocab_size: int
    max_model_len: int
    tokenizer: Any  # a transformers tokenizer; the server deep-copies it for its own encoding thread
    grammars: Grammars
    stats: SpecDecodeStats

    @property
    def is_lossy(self) -> bool:
        """True when verification may change the output distribution."""
        ...

    @property
    def max_running(self) -> int:
        """The admission cap: how many requests run at once."""
        ...

    @property
    def num_running(self) -> int:
        """Requests holding KV blocks now."""
        ...

    @property
    def num_waiting(self) -> int:
        """Requests queued for admission."""
        ...

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting or running."""
        ...

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        prompt_text: str | None = None,
    ) -> None:
        """Queue a request; ValueError (nothing changed) for a bad one."""
        ...

    def abort_request(self, request_id: str) -> None:
        """Stop a request and free what it holds (unknown ids are ignored)."""
        ...

    def step(self) -> list[RequestOutput]:
        """One engine step: an output for every request that got tokens or finished."""
        ...
