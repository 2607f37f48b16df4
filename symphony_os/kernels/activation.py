"""The MLP's gate: SiLU(gate) * up over the fused gate/up projection, in one Triton kernel
(torch takes two, a SiLU and a product, plus the split's views; at decode batch sizes each
kernel costs a few microseconds however small the tensor). Rounds as the torch version does:
the SiLU to the input dtype, then the product."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # columns per program


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, INTERMEDIATE: tl.constexpr, BLOCK: tl.constexpr):
    """Program (row, block): columns [block * BLOCK, ...) of row's gate half and up half."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTERMEDIATE
    source = gate_up_ptr + row * (2 * INTERMEDIATE) + cols
    gate = tl.load(source, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(source + INTERMEDIATE, mask=mask, other=0.0).to(tl.float32)
    silu = (gate * tl.sigmoid(gate)).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * INTERMEDIATE + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up of contiguous gate_up `[T, 2 * I]` (gate the first half): a new `[T, I]`."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or not gate_up.is_contiguous():
        raise ValueError(f"gate_up {tuple(gate_up.shape)} must be contiguous [T, 2 * intermediate]")
    rows, intermediate = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, intermediate, dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        block = min(BLOCK, triton.next_power_of_2(intermediate))
        _silu_mul_kernel[(rows, triton.cdiv(intermediate, block))](gate_up, out, INTERMEDIATE=intermediate,
                                                                    BLOCK=block)
    return out
