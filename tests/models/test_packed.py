"""PackedLinear (eyas/models/packed.py): the prepacked oneDNN product gives F.linear's bits, whatever the rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from eyas.models import packed
from eyas.models.packed import PackedLinear, pack_linears_

pytestmark = pytest.mark.skipif(not packed._AVAILABLE, reason="oneDNN bf16 packing unavailable on this CPU")


def _layer(k: int, n: int, bias: bool = False, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias).to(torch.bfloat16).requires_grad_(False)
    assert pack_linears_(lin) == 1 and type(lin) is PackedLinear
    return lin


# SmolLM2's fused q/k/v, o, gate/up, down and vocabulary projections
@pytest.mark.parametrize("k,n", [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152)])
@pytest.mark.parametrize("threads", [1, 2])
def test_same_bits_as_f_linear_at_every_row_count(k, n, threads):
    lin = _layer(k, n)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for m in [*range(1, 18), 31, 64, 100]:
            x = torch.randn(m, k).to(torch.bfloat16)
            with torch.inference_mode():
                assert torch.equal(lin(x), F.linear(x, lin.weight)), m
    finally:
        torch.set_num_threads(old)
    assert lin.__dict__.get("_eyas_packed") is not None  # the packed path ran


def test_bias_leading_dims_and_a_changed_weight():
    lin = _layer(64, 48, bias=True)
    x = torch.randn(2, 3, 64).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))
        lin.weight.mul_(2)  # an in-place update bumps the version: the copy is remade
        assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))
        lin.weight = nn.Parameter(torch.randn(48, 64).to(torch.bfloat16), requires_grad=False)  # a new tensor
        assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))


def test_copies_leave_the_packed_weight_behind():
    import copy
    import pickle

    lin = _layer(32, 16)
    x = torch.randn(3, 32).to(torch.bfloat16)
    with torch.inference_mode():
        y = lin(x)
    for twin in (copy.deepcopy(lin), pickle.loads(pickle.dumps(lin))):
        assert type(twin) is PackedLinear and "_eyas_packed" not in twin.__dict__
        with torch.inference_mode():
            assert torch.equal(twin(x), y)


def test_state_dict_autograd_and_other_dtypes_are_plain_linear():
    lin = _layer(32, 16)
    assert list(lin.state_dict()) == ["weight"]
    lin.requires_grad_(True)
    x = torch.randn(4, 32).to(torch.bfloat16)
    lin(x).float().sum().backward()  # training takes F.linear: gradients flow
    assert lin.weight.grad is not None
    f32 = nn.Linear(32, 16)
    pack_linears_(f32)
    xf = torch.randn(4, 32)
    with torch.inference_mode():  # float32 at a few rows takes the streaming kernel (same maths), not a packed copy
        torch.testing.assert_close(f32(xf), F.linear(xf, f32.weight, f32.bias), rtol=1e-5, atol=1e-6)
        assert "_eyas_packed" not in f32.__dict__


def test_native_target_projections_are_packed():
    from eyas.models.config import ModelConfig
    from eyas.models.native import NativeLlama

    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=8, max_position_embeddings=128)
    model = NativeLlama(cfg)
    kinds = {type(m) for m in model.modules() if isinstance(m, nn.Linear)}
    assert kinds == {PackedLinear}
