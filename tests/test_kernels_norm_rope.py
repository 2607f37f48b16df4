"""The fused RMSNorm (alone and after the residual add) and rotary-embedding kernels against the
model's torch versions (which the parity tests check against transformers), on contiguous rows
and on heads sliced out of a fused qkv projection."""
from __future__ import annotations

import pytest
import torch

from symphony_os.kernels.norm_rope import add_rms_norm, rms_norm, rope
from symphony_os.model.decoder import apply_rope
from symphony_os.model.decoder import rms_norm as torch_rms_norm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CASES = [
    pytest.param(torch.float32, 2e-6, id="fp32"),
    pytest.param(torch.bfloat16, 1e-2, id="bf16", marks=pytest.mark.skipif(
        DEVICE != "cuda", reason="bf16 kernels are checked on a GPU; the CPU interpreter checks fp32")),
]


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.cpu().double() - expected.double()).norm() / expected.double().norm())


@pytest.mark.parametrize("dtype, tolerance", CASES)
@pytest.mark.parametrize("num_tokens, hidden", [(1, 64), (7, 200), (33, 1024)])
def test_rms_norm_of_rows_matches_torch(num_tokens, hidden, dtype, tolerance):
    generator = torch.Generator().manual_seed(hidden)
    x = (3 * torch.randn(num_tokens, hidden, generator=generator)).to(dtype)
    weight = (1 + torch.randn(hidden, generator=generator) / 4).to(dtype)
    out = rms_norm(x.to(DEVICE), weight.to(DEVICE), 1e-5)
    assert out.shape == x.shape and out.dtype == dtype and not out.isnan().any()
    assert relative_error(out, torch_rms_norm(x, weight, 1e-5)) < tolerance


@pytest.mark.parametrize("dtype, tolerance", CASES)
@pytest.mark.parametrize("num_tokens, hidden", [(1, 64), (7, 200), (33, 1024)])
def test_add_rms_norm_returns_the_norm_of_the_sum_and_the_sum(num_tokens, hidden, dtype, tolerance):
    generator = torch.Generator().manual_seed(hidden + 1)
    x = (3 * torch.randn(num_tokens, hidden, generator=generator)).to(dtype)
    residual = (10 * torch.randn(num_tokens, hidden, generator=generator)).to(dtype)
    weight = (1 + torch.randn(hidden, generator=generator) / 4).to(dtype)
    inputs = [t.to(DEVICE) for t in (x, residual)]
    normed, summed = add_rms_norm(*inputs, weight.to(DEVICE), 1e-5)
    assert torch.equal(summed.cpu(), residual + x)  # rounded to the dtype, as torch's add rounds
    assert torch.equal(inputs[1].cpu(), residual)  # out of place
    assert normed.shape == x.shape and normed.dtype == dtype
    assert relative_error(normed, torch_rms_norm(residual + x, weight, 1e-5)) < tolerance


def test_add_rms_norm_refuses_what_it_cannot_read():
    rows = torch.ones(4, 8, device=DEVICE)
    with pytest.raises(ValueError, match="contiguous"):
        add_rms_norm(rows.t(), rows.t(), torch.ones(4, device=DEVICE), 1e-5)
    with pytest.raises(ValueError, match="one dtype"):
        add_rms_norm(rows, rows.double(), torch.ones(8, device=DEVICE), 1e-5)


@pytest.mark.parametrize("dtype, tolerance", CASES)
def test_rms_norm_and_rope_of_heads_sliced_from_qkv(dtype, tolerance):
    num_tokens, num_heads, num_kv_heads, head_dim = 9, 4, 2, 32
    generator = torch.Generator().manual_seed(1)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=generator).to(dtype)
    q = qkv[:, :num_heads * head_dim].view(num_tokens, num_heads, head_dim)  # strided over tokens
    weight = (1 + torch.randn(head_dim, generator=generator) / 4).to(dtype)
    normed = rms_norm(q.to(DEVICE), weight.to(DEVICE), 1e-6)
    assert relative_error(normed, torch_rms_norm(q, weight, 1e-6)) < tolerance

    positions = torch.arange(100, 100 + num_tokens).float()
    freqs = positions[:, None] / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    qkv_device = qkv.to(DEVICE)
    q_device = qkv_device[:, :num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    rotated = rope(q_device, cos.to(DEVICE), sin.to(DEVICE))
    assert torch.equal(qkv_device.cpu(), qkv)  # out of place
    assert relative_error(rotated, apply_rope(q, cos, sin)) < tolerance
