"""KV pool write kernels: storing new tokens into their slots and copying whole pages over all
layers, checked element for element (and that nothing else in the pool changed)."""
from __future__ import annotations

import pytest
import torch

from symphony_os.kernels.kv_store import copy_pages, store_kv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.bfloat16, id="bf16", marks=pytest.mark.skipif(
        DEVICE != "cuda", reason="bf16 kernels are checked on a GPU; the CPU interpreter checks fp32")),
]


def nan_pool(num_layers, num_pages, page_size, num_kv_heads, head_dim, dtype):
    shape = (num_layers, num_pages, page_size, num_kv_heads, head_dim)
    return (torch.full(shape, float("nan"), dtype=dtype, device=DEVICE),
            torch.full(shape, float("nan"), dtype=dtype, device=DEVICE))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size,num_kv_heads,head_dim", [(4, 2, 16), (16, 3, 64), (16, 1, 16)])
def test_store_kv_writes_exactly_the_mapped_slots(page_size, num_kv_heads, head_dim, dtype):
    num_pages, layer = 6, 1
    pool_k, pool_v = nan_pool(2, num_pages, page_size, num_kv_heads, head_dim, dtype)
    generator = torch.Generator().manual_seed(page_size + head_dim)
    num_tokens = 2 * page_size + 3
    slots = torch.randperm(num_pages * page_size, generator=generator)[:num_tokens]
    slots[2] = -1  # a padding token: skipped
    # k and v as views of a fused kv projection (strided over tokens).
    kv = torch.randn(num_tokens, 2, num_kv_heads, head_dim, generator=generator).to(DEVICE, dtype)
    k, v = kv[:, 0], kv[:, 1]
    store_kv(k, v, pool_k[layer], pool_v[layer], slots.to(DEVICE))

    expected_k, expected_v = nan_pool(2, num_pages, page_size, num_kv_heads, head_dim, dtype)
    for token, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected_k[layer, slot // page_size, slot % page_size] = k[token]
            expected_v[layer, slot // page_size, slot % page_size] = v[token]
    assert torch.equal(pool_k.isnan(), expected_k.isnan()) and torch.equal(pool_v.isnan(), expected_v.isnan())
    assert torch.equal(pool_k.nan_to_num(), expected_k.nan_to_num())
    assert torch.equal(pool_v.nan_to_num(), expected_v.nan_to_num())


def test_store_kv_accepts_int32_slots_and_no_tokens():
    pool_k, pool_v = nan_pool(1, 2, 4, 1, 16, torch.float32)
    k = torch.randn(2, 1, 16, device=DEVICE)
    store_kv(k, -k, pool_k[0], pool_v[0], torch.tensor([5, 0], dtype=torch.int32, device=DEVICE))
    assert torch.equal(pool_k[0, 1, 1], k[0]) and torch.equal(pool_v[0, 0, 0], -k[1])
    store_kv(k[:0], k[:0], pool_k[0], pool_v[0], torch.zeros(0, dtype=torch.int64, device=DEVICE))
    assert int(pool_k.isnan().sum()) == pool_k.numel() - 2 * 16


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size,num_kv_heads,head_dim", [(4, 2, 16), (16, 2, 64)])
def test_copy_pages_copies_every_layer_and_nothing_else(page_size, num_kv_heads, head_dim, dtype):
    num_layers, num_pages = 3, 8
    generator = torch.Generator().manual_seed(page_size)
    shape = (num_layers, num_pages, page_size, num_kv_heads, head_dim)
    pool_k = torch.randn(shape, generator=generator).to(DEVICE, dtype)
    pool_v = torch.randn(shape, generator=generator).to(DEVICE, dtype)
    src, dst = [0, 5, 2], [7, 1, 3]
    expected_k, expected_v = pool_k.clone(), pool_v.clone()
    expected_k[:, dst] = pool_k[:, src]
    expected_v[:, dst] = pool_v[:, src]
    copy_pages(pool_k, pool_v, torch.tensor(src, device=DEVICE), torch.tensor(dst, dtype=torch.int32, device=DEVICE))
    assert torch.equal(pool_k, expected_k) and torch.equal(pool_v, expected_v)


def test_copy_pages_rejects_a_non_contiguous_pool():
    pool = torch.zeros(2, 4, 4, 2, 16, device=DEVICE)
    with pytest.raises(ValueError, match="contiguous"):
        copy_pages(pool[:, ::2], pool[:, ::2], torch.tensor([0], device=DEVICE), torch.tensor([1], device=DEVICE))
