"""The fused SiLU(gate) * up kernel against the model's torch version (transformers' SiLU and a
product), on rows wider and narrower than one program's block."""
from __future__ import annotations

import pytest
import torch
from transformers.activations import ACT2FN

from symphony_os.kernels.activation import BLOCK, silu_mul

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CASES = [
    pytest.param(torch.float32, 1e-6, id="fp32"),
    pytest.param(torch.bfloat16, 1e-2, id="bf16", marks=pytest.mark.skipif(
        DEVICE != "cuda", reason="bf16 kernels are checked on a GPU; the CPU interpreter checks fp32")),
]


@pytest.mark.parametrize("dtype, tolerance", CASES)
@pytest.mark.parametrize("num_tokens, intermediate", [(1, 64), (5, 344), (3, BLOCK + 100)])
def test_silu_mul_matches_torch(num_tokens, intermediate, dtype, tolerance):
    generator = torch.Generator().manual_seed(intermediate)
    gate_up = (4 * torch.randn(num_tokens, 2 * intermediate, generator=generator)).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    expected = ACT2FN["silu"](gate) * up
    out = silu_mul(gate_up.to(DEVICE))
    assert out.shape == expected.shape and out.dtype == dtype
    error = float((out.cpu().double() - expected.double()).norm() / expected.double().norm())
    assert error < tolerance


def test_silu_mul_refuses_what_it_cannot_read():
    with pytest.raises(ValueError, match="contiguous"):
        silu_mul(torch.ones(8, 4, device=DEVICE).t())
    with pytest.raises(ValueError, match="contiguous"):
        silu_mul(torch.ones(4, 7, device=DEVICE))
