"""The bias gradient of a Linear, y = x W^T + b: grad_output summed over its rows, in one kernel.

cuBLASLt's BGRADB epilogue (fused_dense_lib's weight-gradient GEMM) runs the sum as a kernel of its
own after the GEMM, and on the H200 that kernel moves 1.4-2 TB/s (8192 x 3072 bf16: 37 us,
against 14 us for a copy of the same bytes). Here the rows are split into bands, each program sums
a band of a block of columns in fp32 registers, writes its partial row, and the last program of a
column block (by an atomic ticket) adds the bands' partial rows in band order: one launch plus a
memset, bitwise repeatable (the order of the sum never depends on which program finishes last).
"""

import torch
import triton
import triton.language as tl

from flash_attn.ops.triton.launch_device import launch_device, sm_count

# (rows per tile, columns per program, warps, programs per SM): the best at every shape of a sweep
# on the H200 (rows 16/32/64, columns 128/256, 4/8 warps, 2/4/8 programs per SM; 8192 x 1024-4096
# and 16384 x 768-3072 bf16; benchmarks/RESULTS.md, session thirteenth).
_CONFIG = (64, 128, 4, 2)


@triton.jit
def _bias_grad_kernel(G, OUT, PARTIALS, TICKETS, M, N, stride_m, rows_per_band,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr):
    col_block = tl.program_id(0)
    band = tl.program_id(1)
    bands = tl.num_programs(1)
    cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    in_cols = cols < N
    acc_dtype = tl.float64 if G.dtype.element_ty == tl.float64 else tl.float32
    row_start = band * rows_per_band
    row_end = tl.minimum(row_start + rows_per_band, M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=acc_dtype)
    for tile_start in tl.range(row_start, row_end, BLOCK_M, num_stages=NUM_STAGES):
        rows = tile_start + tl.arange(0, BLOCK_M)
        mask = (rows < row_end)[:, None] & in_cols[None, :]
        tile = tl.load(G + rows.to(tl.int64)[:, None] * stride_m + cols[None, :], mask=mask, other=0.0)
        acc += tile.to(acc_dtype)
    tl.store(PARTIALS + band * N + cols, tl.sum(acc, axis=0), mask=in_cols)
    # One thread takes the ticket: the barrier puts every thread's store before it, its release
    # publishes them to the program that draws the last ticket of this column block, whose
    # acquire orders the reads below after them (.cg: read at L2, never a stale L1 line).
    tl.debug_barrier()
    ticket = tl.atomic_add(TICKETS + col_block, 1, sem="acq_rel")
    if ticket == bands - 1:
        total = tl.load(PARTIALS + cols, mask=in_cols, other=0.0, cache_modifier=".cg")
        for b in range(1, bands):
            total += tl.load(PARTIALS + b * N + cols, mask=in_cols, other=0.0, cache_modifier=".cg")
        tl.store(OUT + cols, total.to(OUT.dtype.element_ty), mask=in_cols)


def _sm_count(device):
    if device.type != "cuda":
        return 2  # the interpreter: a few bands, so that the ticket and the band sum run
    return sm_count(device.index)


def _config(N):
    """(rows per tile, columns per program, warps, programs per SM); columns fit N when N is
    smaller than a block."""
    block_m, block_n, num_warps, per_sm = _CONFIG
    return block_m, min(block_n, triton.next_power_of_2(N)), num_warps, per_sm


def bias_grad(grad_output, dtype=None):
    """grad_output (rows, N), row-major with unit column stride, summed over its rows: (N,) in
    dtype (grad_output's by default), accumulated in fp32 (fp64 for fp64 inputs)."""
    if grad_output.dim() != 2 or grad_output.stride(1) != 1:
        raise ValueError("bias_grad: grad_output must be 2-D with contiguous rows, got shape "
                         f"{tuple(grad_output.shape)} and strides {grad_output.stride()}")
    device = launch_device("bias_grad", "grad_output", grad_output)
    M, N = grad_output.shape
    dtype = dtype or grad_output.dtype
    out = torch.empty(N, dtype=dtype, device=grad_output.device)
    if N == 0:
        return out
    if M == 0:
        return out.zero_()
    block_m, block_n, num_warps, per_sm = _config(N)
    col_blocks = triton.cdiv(N, block_n)
    tiles = triton.cdiv(M, block_m)
    bands = max(1, min(tiles, _sm_count(grad_output.device) * per_sm // col_blocks))
    rows_per_band = triton.cdiv(tiles, bands) * block_m
    bands = triton.cdiv(M, rows_per_band)
    acc_dtype = torch.float64 if grad_output.dtype == torch.float64 else torch.float32
    # The partial rows and the tickets (int32 0 is a float 0) in one zeroed buffer: one allocation
    # and one memset, the host's launch time being most of a small sum's cost.
    scratch = torch.zeros(bands * N + col_blocks, dtype=acc_dtype, device=grad_output.device)
    partials = scratch[:bands * N]
    tickets = scratch[bands * N:].view(torch.int32)
    with device:
        _bias_grad_kernel[(col_blocks, bands)](
            grad_output, out, partials, tickets, M, N, grad_output.stride(0), rows_per_band,
            BLOCK_M=block_m, BLOCK_N=block_n, NUM_STAGES=3, num_warps=num_warps)
    return out
