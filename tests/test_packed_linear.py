"""bfloat16 weights prepacked in oneDNN's layout (flyspec/models/packed_linear.py): the same bits as the
plain layout, for layers and for a whole model, so packing is a pure speed choice that changes no output."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny_llm import save_tiny

from flyspec.models.llama import ForwardBatch
from flyspec.models.loader import load_model
from flyspec.models.packed_linear import PackedLinear, pack_reason

pytestmark = pytest.mark.skipif(
    pack_reason() is not None, reason=f"oneDNN cannot pack bf16 here: {pack_reason()}"
)


@pytest.mark.parametrize("bias", [False, True])
def test_a_packed_layer_gives_f_linears_bits(bias: bool) -> None:
    """PackedLinear(x) equals F.linear(x, W, b) bit for bit in bfloat16 for 1, 5 and 33 rows and for a
    3-D input, and its weight is no longer kept plain."""
    torch.manual_seed(0)
    weight = (torch.randn(96, 80) * 0.05).bfloat16()
    b = torch.randn(96).bfloat16() if bias else None
    layer = PackedLinear(weight, b)
    for shape in ((1, 80), (5, 80), (33, 80), (2, 3, 80)):
        x = torch.randn(shape).bfloat16()
        assert torch.equal(layer(x), F.linear(x, weight, b)), shape
    assert not hasattr(layer, "weight") and layer.packed.is_mkldnn


def test_a_packed_model_computes_the_same_logits(tmp_path) -> None:
    """A bfloat16 model with every linear layer and its tied lm_head packed gives the same hidden states
    and logits, bit for bit, as the same weights in the plain layout, for a ragged batch."""
    folder = save_tiny(tmp_path / "m", seed=0)
    plain = load_model(str(folder), dtype="bfloat16").model
    packed = load_model(str(folder), dtype="bfloat16").model
    if not packed.packed:  # the kernel check found packing slower for these tiny shapes: pack anyway
        packed.pack()
    plain_cache, packed_cache = plain.new_cache(8, 16), packed.new_cache(8, 16)
    ids = torch.tensor([[5, 9, 13, 2], [7, 7, 1, 0]])
    tables = torch.tensor([[0], [1]])
    batch = ForwardBatch(block_tables=tables, start=torch.tensor([0, 0]), num_tokens=torch.tensor([4, 3]))
    a, b = plain(ids, batch, plain_cache), packed(ids, batch, packed_cache)
    assert torch.equal(a, b)
    assert torch.equal(plain.compute_logits(a[:, -1]), packed.compute_logits(b[:, -1]))
