"""Loading frees the float weights as it goes (flyspec/models/loader.py, models/quantization.py): each
decoder layer's separate q/k/v and gate/up tensors are gone once that layer is fused and assigned, and each
float weight once its quantized copy exists, so the peak is the float model plus one layer's copies (the
1.5B's int8 load peaked at 5.6-6.3 GB when every one was kept to the end, 4.3 GB now; AMD EPYC Zen 5).
Tiny random-weight models: what is proved is which tensors are alive when, not the bytes."""

from __future__ import annotations

import weakref
from pathlib import Path

import pytest
from tiny_llm import save_tiny

from flyspec.models import loader, quantization
from flyspec.models.llama import LlamaForCausalLM
from flyspec.models.loader import load_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("memory") / "tiny", seed=0, num_layers=4)


def test_each_layers_separate_projections_go_before_the_next_layer_loads(
    tiny: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When a decoder layer starts loading, the separate projections read for every earlier layer are
    freed already (with the whole dict loaded at once, they all lived until the end of the load)."""
    read = loader._read_safetensors
    separate: dict[int, list[weakref.ref]] = {}

    def reading(*args):  # type: ignore[no-untyped-def]
        state = read(*args)
        for key, tensor in state.items():
            if any(part in key for part in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")):
                separate.setdefault(int(key.split(".")[2]), []).append(weakref.ref(tensor))
        return state

    alive_earlier: list[int] = []

    class Watched(LlamaForCausalLM):
        def __init__(self, config) -> None:  # type: ignore[no-untyped-def]
            super().__init__(config)
            for n, layer in enumerate(self.model.layers):
                layer.register_load_state_dict_pre_hook(
                    lambda _, state, prefix, *__, n=n: check(n, state, prefix)
                )

    def check(n: int, state: dict, prefix: str) -> None:
        if any(key.startswith(prefix) for key in state):  # this layer's tensors load now
            alive_earlier.extend(m for m in range(n) for ref in separate[m] if ref() is not None)

    monkeypatch.setattr(loader, "_read_safetensors", reading)
    monkeypatch.setattr(loader, "LlamaForCausalLM", Watched)
    model = load_model(str(tiny), "float32").model
    assert len(separate) == 4 and sum(map(len, separate.values())) == 4 * 5
    assert alive_earlier == []
    assert all(ref() is None for refs in separate.values() for ref in refs)
    assert model.model.layers[3].mlp.gate_up_proj.weight.shape[0] == 2 * model.arch.intermediate_size


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_each_float_weight_goes_once_its_quantized_copy_exists(
    tiny: Path, method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While layer n is quantized, the float weights of layers 0..n-1 are freed (a list of the model's
    modules held every one of them to the end)."""
    model = load_model(str(tiny), "float32").model
    embedding = model.model.embed_tokens.weight
    seen: list[weakref.ref] = []
    alive: list[int] = []
    real = quantization.quantized_linear

    def quantizing(method_, weight, *args, **kwargs):  # type: ignore[no-untyped-def]
        alive.append(sum(ref() is not None and ref() is not embedding for ref in seen))
        seen.append(weakref.ref(weight))
        return real(method_, weight, *args, **kwargs)

    monkeypatch.setattr(quantization, "quantized_linear", quantizing)
    model.quantize(method)
    assert len(seen) >= 4 * 4 and alive == [0] * len(alive)
