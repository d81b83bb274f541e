"""Dropout + residual + LayerNorm / RMSNorm in Triton (any hidden size up to 64 KB per row).

    x = dropout(x * rowscale) [+ dropout(x1)] [+ residual]         (the pre-norm sum)
    y = norm(x) * weight + bias,  y1 = norm(x) * weight1 + bias1    (statistics in fp32)

The forward keeps whole rows in registers (one or a few rows per program); the backward walks a
band of rows per program, a tile of rows at a time in a software-pipelined loop, and keeps the
weight / bias gradient sums in registers, then adds the bands up: with fp32 atomics, the last
program writing the gradients, or deterministically in PyTorch (_atomic_param_grads). The tile
shapes and the pipelining depth come from _fwd_tile / _bwd_tile / _bwd_num_stages (measured on
the H200).
Dropout draws come from Philox (four per call, _dropout) with one seed per row taken from
PyTorch's generator, so the backward regenerates the mask instead of reading it. Runs on CPU
tensors under TRITON_INTERPRET=1.
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from flash_attn.ops.triton.launch_device import launch_device
from flash_attn.ops.triton.launch_device import sm_count as _sm_count  # (tests patch this name)

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# --------------------------------------------------------------------------------------------
# References (plain PyTorch)
# --------------------------------------------------------------------------------------------

def _ref_prologue(x, weight, bias, residual, x1, weight1, bias1, dropout_p, rowscale,
                  zero_centered_weight, dropout_mask, dropout_mask1, upcast):
    """The pre-norm sum and the (possibly shifted) weights shared by both references."""
    if upcast:
        up = lambda t: t.float() if t is not None else None  # noqa: E731
        x, weight, bias, residual = up(x), up(weight), up(bias), up(residual)
        x1, weight1, bias1 = up(x1), up(weight1), up(bias1)
    if zero_centered_weight:
        weight = weight + 1.0
        weight1 = weight1 + 1.0 if weight1 is not None else None
    if x1 is not None and rowscale is not None:
        raise ValueError("rowscale is not supported together with x1")
    if rowscale is not None:
        x = x * rowscale[..., None]

    def drop(t, mask):
        if dropout_p == 0.0:
            return t
        if mask is None:
            return F.dropout(t, p=dropout_p)
        return t.masked_fill(~mask, 0.0) / (1.0 - dropout_p)

    x = drop(x, dropout_mask)
    if x1 is not None:
        x = x + drop(x1, dropout_mask1)
    if residual is not None:
        x = (x + residual).to(x.dtype)
    return x, weight, bias, weight1, bias1


def _ref_outputs(out, out1, x, prenorm):
    outs = (out,) + ((out1,) if out1 is not None else ()) + ((x,) if prenorm else ())
    return outs[0] if len(outs) == 1 else outs


def layer_norm_ref(x, weight, bias, residual=None, x1=None, weight1=None, bias1=None, eps=1e-6,
                   dropout_p=0.0, rowscale=None, prenorm=False, zero_centered_weight=False,
                   dropout_mask=None, dropout_mask1=None, upcast=False):
    """Returns out [, out1] [, pre-norm sum] like layer_norm_fn. dropout_mask: the kept positions
    (bool); without it F.dropout draws its own."""
    dtype = x.dtype
    x, weight, bias, weight1, bias1 = _ref_prologue(
        x, weight, bias, residual, x1, weight1, bias1, dropout_p, rowscale, zero_centered_weight,
        dropout_mask, dropout_mask1, upcast)
    norm = lambda w, b: F.layer_norm(x.to(w.dtype), x.shape[-1:], w, b, eps).to(dtype)  # noqa
    out1 = norm(weight1, bias1) if weight1 is not None else None
    return _ref_outputs(norm(weight, bias), out1, x, prenorm)


def rms_norm_ref(x, weight, bias, residual=None, x1=None, weight1=None, bias1=None, eps=1e-6,
                 dropout_p=0.0, rowscale=None, prenorm=False, zero_centered_weight=False,
                 dropout_mask=None, dropout_mask1=None, upcast=False):
    dtype = x.dtype
    x, weight, bias, weight1, bias1 = _ref_prologue(
        x, weight, bias, residual, x1, weight1, bias1, dropout_p, rowscale, zero_centered_weight,
        dropout_mask, dropout_mask1, upcast)
    rstd = torch.rsqrt(x.square().mean(dim=-1, keepdim=True) + eps)

    def norm(w, b):
        y = x * rstd * w
        return (y + b if b is not None else y).to(dtype)

    out1 = norm(weight1, bias1) if weight1 is not None else None
    return _ref_outputs(norm(weight, bias), out1, x, prenorm)


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------

@triton.jit
def _dropout(v, SEEDS, rows, in_rows, dropout_p, BLOCK_N: tl.constexpr):
    """(v dropped and rescaled, keep mask) for the (rows, BLOCK_N) tile v, with the rows' seeds at
    SEEDS: 7 Philox rounds (enough mixing for dropout, fewer registers than the default 10), one
    seed per row and the column as the counter, so the backward draws the same mask. Each Philox
    call gives four 32-bit draws: column c takes draw c % 4 of counter c // 4, a quarter of the
    calls of one draw per column (the draws were what bound the dropout kernels: about 100
    integer instructions per element against 9-11 bytes)."""
    seeds = tl.load(SEEDS + rows, mask=in_rows, other=0).to(tl.uint32)
    if BLOCK_N >= 4:
        quads = tl.arange(0, BLOCK_N // 4)
        r0, r1, r2, r3 = tl.randint4x(seeds[:, None], quads[None, :], n_rounds=7)
        # interleave(interleave(r0, r2), interleave(r1, r3)) = r0, r1, r2, r3 of each counter.
        draws = tl.interleave(tl.interleave(r0, r2), tl.interleave(r1, r3))
    else:
        draws = tl.randint(seeds[:, None], tl.arange(0, BLOCK_N)[None, :], n_rounds=7)
    keep = tl.random.uint_to_uniform_float(draws) > dropout_p
    return tl.where(keep, v / (1.0 - dropout_p), 0.0), keep


@triton.jit
def _layer_norm_fwd_kernel(
    X, Y, W, B, RESIDUAL, X1, W1, B1, Y1, RESIDUAL_OUT, ROWSCALE, SEEDS, DROPOUT_MASK,
    DROPOUT_MASK1, MEAN, RSTD, BWD_SUMS,
    stride_x_row, stride_y_row, stride_res_row, stride_res_out_row, stride_x1_row, stride_y1_row,
    M, N, eps, dropout_p, bwd_sums_numel,
    IS_RMS_NORM: tl.constexpr, BLOCK_N: tl.constexpr, ROWS_PER_PROGRAM: tl.constexpr,
    ZERO_CENTERED_WEIGHT: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    STORE_RESIDUAL_OUT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    STORE_DROPOUT_MASK: tl.constexpr, HAS_ROWSCALE: tl.constexpr, HAS_X1: tl.constexpr,
    HAS_W1: tl.constexpr, HAS_B1: tl.constexpr, NUM_STAGES: tl.constexpr,
    ZERO_BWD_SUMS: tl.constexpr,
):
    # Tiles of ROWS_PER_PROGRAM whole rows, held in registers; several rows per tile share one
    # load of the weights at small hidden sizes. A program takes tiles pid, pid + programs, ...
    # in a loop pipelined NUM_STAGES deep (the next tile's loads in flight while this one
    # reduces); with one tile per program the loop runs once.
    cols = tl.arange(0, BLOCK_N)
    in_row = cols < N
    if ZERO_BWD_SUMS:
        # The backward's atomic sums (and ticket), zeroed here: the backward then needs no
        # memset of its own (a graph node of its own at hidden 1K; _layer_norm_bwd's bwd_sums).
        step = tl.num_programs(0) * BLOCK_N
        for start in range(tl.program_id(0) * BLOCK_N, bwd_sums_numel, step):
            tl.store(BWD_SUMS + start + cols, 0.0, mask=start + cols < bwd_sums_numel)
    w = tl.load(W + cols, mask=in_row).to(tl.float32)
    if ZERO_CENTERED_WEIGHT:
        w += 1.0
    if HAS_BIAS:
        b = tl.load(B + cols, mask=in_row).to(tl.float32)
    if HAS_W1:
        w1 = tl.load(W1 + cols, mask=in_row).to(tl.float32)
        if ZERO_CENTERED_WEIGHT:
            w1 += 1.0
        if HAS_B1:
            b1 = tl.load(B1 + cols, mask=in_row).to(tl.float32)
    n_tiles = tl.cdiv(M, ROWS_PER_PROGRAM)
    for tile in tl.range(tl.program_id(0), n_tiles, tl.num_programs(0), num_stages=NUM_STAGES):
        rows = tl.arange(0, ROWS_PER_PROGRAM).to(tl.int64) + tile * ROWS_PER_PROGRAM
        in_rows = rows < M
        mask = in_rows[:, None] & in_row[None, :]
        row, col = rows[:, None], cols[None, :]  # 64-bit offsets: rows * stride may pass 2^31
        x = tl.load(X + row * stride_x_row + col, mask=mask, other=0.0).to(tl.float32)
        if HAS_ROWSCALE:
            x *= tl.load(ROWSCALE + rows, mask=in_rows, other=0.0).to(tl.float32)[:, None]
        if HAS_DROPOUT:
            x, keep = _dropout(x, SEEDS, rows, in_rows, dropout_p, BLOCK_N)
            if STORE_DROPOUT_MASK:
                tl.store(DROPOUT_MASK + row * N + col, keep, mask=mask)
        if HAS_X1:
            x1 = tl.load(X1 + row * stride_x1_row + col, mask=mask, other=0.0).to(tl.float32)
            if HAS_DROPOUT:
                x1, keep1 = _dropout(x1, SEEDS + M, rows, in_rows, dropout_p, BLOCK_N)
                if STORE_DROPOUT_MASK:
                    tl.store(DROPOUT_MASK1 + row * N + col, keep1, mask=mask)
            x += x1
        if HAS_RESIDUAL:
            x += tl.load(RESIDUAL + row * stride_res_row + col, mask=mask,
                         other=0.0).to(tl.float32)
        if STORE_RESIDUAL_OUT:
            tl.store(RESIDUAL_OUT + row * stride_res_out_row + col, x, mask=mask)
        # Two-pass statistics over the rows held in registers.
        if IS_RMS_NORM:
            xc = x
        else:
            mean = tl.sum(x, axis=1) / N
            tl.store(MEAN + rows, mean, mask=in_rows)
            xc = tl.where(mask, x - mean[:, None], 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / N + eps)
        tl.store(RSTD + rows, rstd, mask=in_rows)
        xhat = xc * rstd[:, None]
        y = xhat * w[None, :]
        if HAS_BIAS:
            y += b[None, :]
        tl.store(Y + row * stride_y_row + col, y, mask=mask)
        if HAS_W1:
            y1 = xhat * w1[None, :]
            if HAS_B1:
                y1 += b1[None, :]
            tl.store(Y1 + row * stride_y1_row + col, y1, mask=mask)


@triton.jit
def _add_pairs(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


@triton.jit
def _sum_copies(SUMS, cols, in_row, N, SUM_COPIES: tl.constexpr):
    # .cg: read at L2, where the atomics landed, never a stale L1 line.
    total = tl.load(SUMS + cols, mask=in_row, other=0.0, cache_modifier=".cg")
    for c in tl.static_range(1, SUM_COPIES):
        total += tl.load(SUMS + c * N + cols, mask=in_row, other=0.0, cache_modifier=".cg")
    return total


@triton.jit
def _zero_copies(SUMS, cols, in_row, N, SUM_COPIES: tl.constexpr):
    for c in tl.static_range(SUM_COPIES):
        tl.store(SUMS + c * N + cols, 0.0, mask=in_row)


@triton.jit
def _layer_norm_bwd_kernel(
    X, W, B, Y, DY, DX, DW, DB, DRESIDUAL, W1, DY1, DX1, DW1, DB1, DRESIDUAL_IN, ROWSCALE, SEEDS,
    MEAN, RSTD, DW_OUT, DB_OUT, DW1_OUT, DB1_OUT, TICKETS,
    stride_x_row, stride_y_row, stride_dy_row, stride_dx_row, stride_dres_row, stride_dy1_row,
    stride_dx1_row, stride_dres_in_row,
    M, N, dropout_p, rows_per_program,
    IS_RMS_NORM: tl.constexpr, BLOCK_N: tl.constexpr, ROWS_PER_ITER: tl.constexpr,
    NUM_STAGES: tl.constexpr, ZERO_CENTERED_WEIGHT: tl.constexpr, HAS_DRESIDUAL: tl.constexpr,
    STORE_DRESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    HAS_ROWSCALE: tl.constexpr, HAS_DY1: tl.constexpr, HAS_DX1: tl.constexpr,
    HAS_B1: tl.constexpr, RECOMPUTE_OUTPUT: tl.constexpr, ATOMIC_PARAM_GRADS: tl.constexpr,
    SUM_COPIES: tl.constexpr, REZERO_SUMS: tl.constexpr,
):
    # DW / DB / DW1 / DB1: fp32 sums of the parameter gradients. ATOMIC_PARAM_GRADS: SUM_COPIES
    # zeroed rows each that the programs add into, and the last program to finish (by the
    # TICKETS count) writes their sum to DW_OUT / ... in the parameters' dtypes (REZERO_SUMS: and
    # zeroes them again, for the next backward of the forward that zeroed them); otherwise a row
    # per program (programs x N) that the launcher sums.
    # Each iteration takes a tile of ROWS_PER_ITER rows of the program's band, and the loop is
    # pipelined NUM_STAGES deep: the next tiles' loads are in flight while this one reduces.
    pid = tl.program_id(0)
    row_start = pid.to(tl.int64) * rows_per_program  # 64-bit offsets: rows * stride may pass 2^31
    row_end = tl.minimum(row_start + rows_per_program, M)
    cols = tl.arange(0, BLOCK_N)
    in_row = cols < N
    tile_rows = tl.arange(0, ROWS_PER_ITER)
    w = tl.load(W + cols, mask=in_row, other=0.0).to(tl.float32)
    if ZERO_CENTERED_WEIGHT:
        w += 1.0
    if RECOMPUTE_OUTPUT and HAS_BIAS:
        b = tl.load(B + cols, mask=in_row, other=0.0).to(tl.float32)
    if HAS_DY1:
        w1 = tl.load(W1 + cols, mask=in_row, other=0.0).to(tl.float32)
        if ZERO_CENTERED_WEIGHT:
            w1 += 1.0
    # The weight / bias gradients are summed per tile row and folded once, after the loop.
    dw = tl.zeros((ROWS_PER_ITER, BLOCK_N), dtype=tl.float32)
    if HAS_BIAS:
        db = tl.zeros((ROWS_PER_ITER, BLOCK_N), dtype=tl.float32)
    if HAS_DY1:
        dw1 = tl.zeros((ROWS_PER_ITER, BLOCK_N), dtype=tl.float32)
        if HAS_B1:
            db1 = tl.zeros((ROWS_PER_ITER, BLOCK_N), dtype=tl.float32)
    for tile_start in tl.range(row_start, row_end, ROWS_PER_ITER, num_stages=NUM_STAGES):
        rows = tile_start + tile_rows
        in_band = rows < row_end
        # Rows past the band load as zeros: xhat and dy are 0 there, so they add nothing to dw.
        mask = in_band[:, None] & in_row[None, :]
        row, col = rows[:, None], cols[None, :]
        x = tl.load(X + row * stride_x_row + col, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=in_band, other=0.0)[:, None]
        if IS_RMS_NORM:
            xhat = x * rstd
        else:
            xhat = (x - tl.load(MEAN + rows, mask=in_band, other=0.0)[:, None]) * rstd
        xhat = tl.where(mask, xhat, 0.0)
        if RECOMPUTE_OUTPUT:
            y = xhat * w[None, :]
            if HAS_BIAS:
                y += b[None, :]
            tl.store(Y + row * stride_y_row + col, y, mask=mask)
        dy = tl.load(DY + row * stride_dy_row + col, mask=mask, other=0.0).to(tl.float32)
        dw += dy * xhat
        if HAS_BIAS:
            db += dy
        wdy = w[None, :] * dy
        if HAS_DY1:
            dy1 = tl.load(DY1 + row * stride_dy1_row + col, mask=mask,
                          other=0.0).to(tl.float32)
            dw1 += dy1 * xhat
            if HAS_B1:
                db1 += dy1
            wdy += w1[None, :] * dy1
        if IS_RMS_NORM:
            c1 = (tl.sum(xhat * wdy, axis=1) / N)[:, None]
            dx = (wdy - xhat * c1) * rstd
        else:
            # Both row sums in one reduction: one trip through shared memory (1% at 1K).
            s1, s2 = tl.reduce((xhat * wdy, wdy), 1, _add_pairs)
            dx = (wdy - (xhat * (s1 / N)[:, None] + (s2 / N)[:, None])) * rstd
        # dx is now the gradient of the pre-norm sum.
        if HAS_DRESIDUAL:
            dx += tl.load(DRESIDUAL + row * stride_dres_row + col, mask=mask,
                          other=0.0).to(tl.float32)
        if STORE_DRESIDUAL:
            tl.store(DRESIDUAL_IN + row * stride_dres_in_row + col, dx, mask=mask)
        if HAS_DX1:
            if HAS_DROPOUT:
                # The forward's mask of x1, drawn again.
                dx1, _ = _dropout(dx, SEEDS + M, rows, in_band, dropout_p, BLOCK_N)
            else:
                dx1 = dx
            tl.store(DX1 + row * stride_dx1_row + col, dx1, mask=mask)
        if HAS_DROPOUT:
            dx, _ = _dropout(dx, SEEDS, rows, in_band, dropout_p, BLOCK_N)
        if HAS_ROWSCALE:
            dx *= tl.load(ROWSCALE + rows, mask=in_band, other=0.0).to(tl.float32)[:, None]
        tl.store(DX + row * stride_dx_row + col, dx, mask=mask)
    if ATOMIC_PARAM_GRADS:
        # Relaxed adds (fire-and-forget reductions at L2): the ticket below orders them. Each
        # program adds into one of SUM_COPIES rows, so that fewer adds queue on each address.
        copy = (pid % SUM_COPIES) * N + cols
        tl.atomic_add(DW + copy, tl.sum(dw, axis=0), mask=in_row, sem="relaxed")
        if HAS_BIAS:
            tl.atomic_add(DB + copy, tl.sum(db, axis=0), mask=in_row, sem="relaxed")
        if HAS_DY1:
            tl.atomic_add(DW1 + copy, tl.sum(dw1, axis=0), mask=in_row, sem="relaxed")
            if HAS_B1:
                tl.atomic_add(DB1 + copy, tl.sum(db1, axis=0), mask=in_row, sem="relaxed")
        # The ticket is taken by one thread: the barrier makes every thread's adds precede it,
        # and its release publishes them to the program that draws the last ticket, whose
        # acquire (then the ticket's broadcast through shared memory) orders its reads after.
        # (The modulo: a replay of the kernel alone, without the zeroing, still runs this tail.)
        tl.debug_barrier()
        ticket = tl.atomic_add(TICKETS, 1, sem="acq_rel")
        if ticket % tl.num_programs(0) == tl.num_programs(0) - 1:
            tl.store(DW_OUT + cols, _sum_copies(DW, cols, in_row, N, SUM_COPIES), mask=in_row)
            if HAS_BIAS:
                tl.store(DB_OUT + cols, _sum_copies(DB, cols, in_row, N, SUM_COPIES), mask=in_row)
            if HAS_DY1:
                tl.store(DW1_OUT + cols, _sum_copies(DW1, cols, in_row, N, SUM_COPIES),
                         mask=in_row)
                if HAS_B1:
                    tl.store(DB1_OUT + cols, _sum_copies(DB1, cols, in_row, N, SUM_COPIES),
                             mask=in_row)
            if REZERO_SUMS:
                tl.debug_barrier()  # every thread's reads of the sums before any zero lands
                _zero_copies(DW, cols, in_row, N, SUM_COPIES)
                if HAS_BIAS:
                    _zero_copies(DB, cols, in_row, N, SUM_COPIES)
                if HAS_DY1:
                    _zero_copies(DW1, cols, in_row, N, SUM_COPIES)
                    if HAS_B1:
                        _zero_copies(DB1, cols, in_row, N, SUM_COPIES)
    else:
        tl.store(DW + pid * N + cols, tl.sum(dw, axis=0), mask=in_row)
        if HAS_BIAS:
            tl.store(DB + pid * N + cols, tl.sum(db, axis=0), mask=in_row)
        if HAS_DY1:
            tl.store(DW1 + pid * N + cols, tl.sum(dw1, axis=0), mask=in_row)
            if HAS_B1:
                tl.store(DB1 + pid * N + cols, tl.sum(db1, axis=0), mask=in_row)


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------

def maybe_contiguous(x):
    """flash-attn 2.8's helper: x made contiguous, or None."""
    return x.contiguous() if x is not None else None


def maybe_contiguous_lastdim(x):
    """flash-attn 2.8's helper: x with a contiguous last dimension, or None."""
    return x.contiguous() if x is not None and x.stride(-1) != 1 else x


def triton_autotune_configs():
    """flash-attn 2.8's autotuning space of these kernels: one config per warp count (1 to 32)
    that fits a block of 1024 threads of the current device (warps of 32 without CUDA)."""
    warp_size = 32
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        warp_size = getattr(props, "warp_size", 32) or 32
    return [triton.Config({}, num_warps=w) for w in (1, 2, 4, 8, 16, 32) if w * warp_size <= 1024]


def _block_n(x, N):
    # The row lives in registers: at most 64 KB of input per row.
    max_block = 65536 // x.element_size()
    if N > max_block:
        raise ValueError(f"layer_norm_fn: the hidden size ({N}) must be at most {max_block} for "
                         f"{x.dtype} inputs (64 KB per row)")
    return triton.next_power_of_2(N)


# Hidden 1K-8K on the H200 (bf16; the sweeps of LayerNorm, RMSNorm and dropout + residual +
# LayerNorm in benchmarks/RESULTS.md, session sixth, the config with the best worst case): forward
# (rows per tile, warps, looping programs per SM, stages), the backward's programs per SM (2K: 3,
# session fifteenth, once the forward zeroed the sums: LayerNorm 85.3-85.5% of copy against
# 82.5-84.2% at 2, three alternating runs each, graph-timed).
_FWD_TILES = {1024: (1, 1, 16, 3), 2048: (1, 4, 4, 4), 4096: (1, 4, 4, 3), 8192: (1, 8, 2, 3)}
_BWD_PROGRAMS_PER_SM = {1024: 4, 2048: 3, 4096: 4, 8192: 2}
# Shared memory that the tiles in flight of a pipelined loop may take (Triton stages them there):
# under the H200's 227 KB a block, with room for the reductions' scratch.
_PIPELINE_SMEM_BYTES = 160 * 1024


def _fwd_tile(block_n):
    """(rows per tile, num_warps) of the forward: _FWD_TILES at 1K-8K (at 1K a row on one warp,
    87-88% of copy looping 16 programs per SM, against 76-82% for a program per row on 4 warps);
    otherwise a row on block_n / 512 warps (up to 16), shorter rows grouped up to 1K elements."""
    if block_n in _FWD_TILES:
        return _FWD_TILES[block_n][:2]
    rows = min(max(1024 // block_n, 1), 16)
    tile = rows * block_n
    return rows, (min(max(tile // 256, 1), 4) if tile <= 2048 else min(tile // 512, 16))


def _fwd_programs_per_sm(block_n):
    """Forward programs per SM that loop over the tiles (_FWD_TILES, 1K-8K), or None: a program
    per tile. A looping program loads the weights once and has the next tiles' loads in flight
    while this one reduces; at 4K / 8K with dropout it moved 57-74% of copy to 95-97%."""
    return _FWD_TILES[block_n][2] if block_n in _FWD_TILES else None


def _fwd_num_stages(block_n):
    """Pipelining depth of the forward's tile loop (_FWD_TILES); 1 where a program takes one tile,
    as before the loop existed: staging a one-trip loop only takes shared memory (at 4K, a program
    per row staged 2 deep gave LayerNorm 67.5% of copy in the session-six sweep)."""
    return _FWD_TILES[block_n][3] if block_n in _FWD_TILES else 1


def _tile_bytes(rows, block_n, *row_inputs):
    """Bytes a loop iteration loads of the row inputs (the absent ones None) for a tile of rows."""
    return rows * block_n * sum(t.element_size() for t in row_inputs if t is not None)


def _pipeline_stages(stages, tile_bytes):
    """stages, fewer where the stages - 1 tiles in flight (tile_bytes of loads each) would not fit
    _PIPELINE_SMEM_BYTES (fp32 rows or several row inputs at 4K and up)."""
    return max(1, min(stages, 1 + _PIPELINE_SMEM_BYTES // max(tile_bytes, 1)))


def _fwd_programs(x, M, rows_per_program, block_n):
    """Forward grid: every tile, or at most _fwd_programs_per_sm per SM looping over the tiles
    (3 programs on CPU, so that the interpreter runs the loop too)."""
    tiles = triton.cdiv(M, rows_per_program)
    if not x.is_cuda:
        return min(tiles, 3)
    per_sm = _fwd_programs_per_sm(block_n)
    return tiles if per_sm is None else min(tiles, _sm_count(x.device.index) * per_sm)


def _bwd_tile(block_n):
    """(rows per loop iteration, num_warps) of the backward: one row a step, block_n / 512 warps
    (1 to 16): the best or within 2% of it at hidden 1K-8K in the H200 sweeps (session fifth, run
    A: 1/2/4 warps at 1K, 4/8 at 2K, 8/16 at 4K and 8K; session sixth: 2 and 4 rows a step at 1K
    and 2K, 1-3% slower). The knob stays for other GPUs."""
    return 1, min(max(block_n // 512, 1), 16)


def _bwd_num_stages(block_n):
    """Software-pipelining depth of the backward's row loop (tl.range num_stages): the next rows'
    loads are issued while this row reduces. 4 (session sixth: of 3-6 at 1K, 3-5 at 2K-8K) was the
    best or within 1% at every hidden size, and lifted dropout_add_ln from 80 to 91% at 2K."""
    return 4


def _op_name(is_rms_norm):
    return "rms_norm_fn" if is_rms_norm else "layer_norm_fn"


def _check_fwd_args(x, weight, bias, residual, x1, weight1, bias1, dropout_p, rowscale, out,
                    residual_out):
    """Every argument check of the forward, with the argument's name in the message."""
    def fail(msg):
        raise ValueError(f"layer_norm_fn: {msg}")

    if x.dtype not in _DTYPES:
        fail(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    M, N = x.shape
    for name, t, shape in (("weight", weight, (N,)), ("bias", bias, (N,)),
                           ("weight1", weight1, (N,)), ("bias1", bias1, (N,)),
                           ("residual", residual, (M, N)), ("x1", x1, (M, N)),
                           ("rowscale", rowscale, (M,)), ("out", out, (M, N)),
                           ("residual_out", residual_out, (M, N))):
        if t is None:
            continue
        if tuple(t.shape) != shape:
            fail(f"{name} must have shape {shape} (x has {M} rows of {N}), got {tuple(t.shape)}")
        if t.device != x.device:
            fail(f"{name} must be on {x.device} like x, got {t.device}")
        if t.stride(-1) != 1:
            fail(f"{name} must have a contiguous last dimension")
    if weight is None:
        fail("weight is required")
    if bias1 is not None and weight1 is None:
        fail("bias1 needs weight1")
    if x1 is not None and rowscale is not None:
        fail("rowscale is not supported together with x1")
    if not 0.0 <= dropout_p < 1.0:
        fail(f"dropout_p must be in [0, 1), got {dropout_p}")


def _layer_norm_fwd(x, weight, bias, eps, residual=None, x1=None, weight1=None, bias1=None,
                    dropout_p=0.0, rowscale=None, out_dtype=None, residual_dtype=None,
                    zero_centered_weight=False, is_rms_norm=False, return_dropout_mask=False,
                    out=None, residual_out=None, bwd_sums=False):
    """2-D inputs. Returns (y, y1, mean, rstd, residual_out, seeds, dropout_mask, dropout_mask1,
    bwd_sums); residual_out is x itself when nothing changes the input (then it is not written).
    bwd_sums: also return the atomic backward's sums buffer, zeroed by this kernel (None when
    the backward will not take the atomic path or there are no rows): pass it to
    _layer_norm_bwd."""
    _check_fwd_args(x, weight, bias, residual, x1, weight1, bias1, dropout_p, rowscale, out,
                    residual_out)
    device = launch_device(_op_name(is_rms_norm), "x", x)
    M, N = x.shape
    if residual is not None:
        residual_dtype = residual.dtype
    if out is None:
        out = torch.empty_like(x, dtype=x.dtype if out_dtype is None else out_dtype)
    y1 = torch.empty_like(out) if weight1 is not None else None
    changes_input = (residual is not None or x1 is not None or dropout_p > 0.0
                     or rowscale is not None
                     or (residual_dtype is not None and residual_dtype != x.dtype))
    if residual_out is None and changes_input:
        residual_out = torch.empty_like(x, dtype=residual_dtype or x.dtype)
    mean = None if is_rms_norm else torch.empty(M, dtype=torch.float32, device=x.device)
    rstd = torch.empty(M, dtype=torch.float32, device=x.device)
    seeds = None
    if dropout_p > 0.0:
        seeds = torch.randint(2**32, (2 * M if x1 is not None else M,), device=x.device,
                              dtype=torch.int64)
    dropout_mask = dropout_mask1 = None
    if return_dropout_mask and dropout_p > 0.0:
        dropout_mask = torch.empty(M, N, dtype=torch.bool, device=x.device)
        if x1 is not None:
            dropout_mask1 = torch.empty(M, N, dtype=torch.bool, device=x.device)
    block_n = _block_n(x, N)
    rows_per_program, num_warps = _fwd_tile(block_n)
    if bwd_sums and M > 0 and _atomic_param_grads():
        n_params = sum(t is not None for t in (weight, bias, weight1, bias1))
        sum_copies = _bwd_sum_copies(block_n, _bwd_grid(x, M, block_n)[2])
        bwd_sums = torch.empty(_bwd_sums_numel(n_params, sum_copies, N), dtype=torch.float32,
                               device=x.device)
    else:
        bwd_sums = None
    if M > 0:
        with device:
            _layer_norm_fwd_kernel[(_fwd_programs(x, M, rows_per_program, block_n),)](
                x, out, weight, bias, residual, x1, weight1, bias1, y1, residual_out, rowscale,
                seeds, dropout_mask, dropout_mask1, mean, rstd, bwd_sums,
                x.stride(0), out.stride(0),
                residual.stride(0) if residual is not None else 0,
                residual_out.stride(0) if residual_out is not None else 0,
                x1.stride(0) if x1 is not None else 0,
                y1.stride(0) if y1 is not None else 0,
                M, N, eps, dropout_p, bwd_sums.numel() if bwd_sums is not None else 0,
                IS_RMS_NORM=is_rms_norm, BLOCK_N=block_n, ROWS_PER_PROGRAM=rows_per_program,
                ZERO_CENTERED_WEIGHT=zero_centered_weight,
                HAS_RESIDUAL=residual is not None, STORE_RESIDUAL_OUT=residual_out is not None,
                HAS_BIAS=bias is not None, HAS_DROPOUT=dropout_p > 0.0,
                STORE_DROPOUT_MASK=dropout_mask is not None, HAS_ROWSCALE=rowscale is not None,
                HAS_X1=x1 is not None, HAS_W1=weight1 is not None, HAS_B1=bias1 is not None,
                NUM_STAGES=_pipeline_stages(_fwd_num_stages(block_n), _tile_bytes(
                    rows_per_program, block_n, x, residual, x1)),
                ZERO_BWD_SUMS=bwd_sums is not None,
                num_warps=num_warps,
            )
    return (out, y1, mean, rstd, residual_out if residual_out is not None else x, seeds,
            dropout_mask, dropout_mask1, bwd_sums)


def _bwd_programs_per_sm(block_n):
    """Backward programs per SM: _BWD_PROGRAMS_PER_SM at 1K-8K (sessions fifth and sixth: 4/8/16/32
    at 1K, 2/4/8 at 2K, 1/2/4 at 4K, 1/2 at 8K; fifteenth: 2-8 at 1K-2K); elsewhere 4 up to 4K, 1
    beyond (4K elements of rows a program below 1K). Each program also adds a row of sums (fp32,
    N wide, per parameter) into the gradients, or writes a row of partials that the final sum
    reads: fewer programs, less of it."""
    if block_n in _BWD_PROGRAMS_PER_SM:
        return _BWD_PROGRAMS_PER_SM[block_n]
    return 1 if block_n >= 8192 else min(max(4096 // block_n, 4), 32)


def _bwd_bands(x, M, rows_per_iter, block_n):
    """(programs, rows per program) of the backward: bands of whole tiles, one band per
    program, at most _bwd_programs_per_sm programs per SM (4 programs on CPU)."""
    max_programs = (_sm_count(x.device.index) * _bwd_programs_per_sm(block_n) if x.is_cuda
                    else 4)
    tiles = triton.cdiv(max(M, 1), rows_per_iter)
    rows_per_program = triton.cdiv(tiles, max_programs) * rows_per_iter
    return triton.cdiv(max(M, 1), rows_per_program), rows_per_program


def _bwd_grid(x, M, block_n):
    """(rows per loop iteration, num_warps, programs, rows per program) of the backward of x's
    M rows: _bwd_tile and _bwd_bands (the forward sizes the backward's sums by it too)."""
    rows_per_iter, num_warps = _bwd_tile(block_n)
    return (rows_per_iter, num_warps) + _bwd_bands(x, M, rows_per_iter, block_n)


def _bwd_sum_copies(block_n, programs):
    """Rows of fp32 sums per parameter that the atomic backward spreads its programs' adds over
    (program p adds into row p % copies): adds to one address queue at L2, and at hidden 1K one
    row took 500+ programs' adds on the same few cache lines at the kernel's end. The last program
    reads the copies back, so they stay within 8K elements per parameter, and at most 4 (at 1K, 4
    were 1% faster than 8 or 2, and 6% faster than 16; session sixth)."""
    return max(1, min(4, 8192 // block_n, programs))


def _bwd_sums_numel(n_params, sum_copies, N):
    """fp32 elements of the atomic backward's sums: sum_copies rows of N per parameter, then the
    ticket counter (an int32 0 is fp32 0.0, so one zeroing covers both)."""
    return n_params * sum_copies * N + 1


def _atomic_param_grads():
    """Whether the backward finishes the weight / bias gradients in its own kernel: every program
    adds its sums into zeroed fp32 rows per parameter (_bwd_sum_copies) with atomics, and the
    last program to finish writes the gradients in the parameters' dtypes (one kernel, its rows
    zeroed by the forward's kernel; a memset where no forward zeroed them). The other way, a row of partial sums per program summed and cast by PyTorch, costs
    two more launches (several microseconds each at hidden 1K, also inside a CUDA graph) but is
    bitwise repeatable: fp32 atomics add in the order they land, so the last bits change from
    run to run. Hence the atomics unless torch.use_deterministic_algorithms(True). Both ways run
    on CPU too (the interpreter runs the programs one after another, so the last ticket is the
    last program)."""
    return not torch.are_deterministic_algorithms_enabled()


def _per_param(rows, present):
    """(weight, bias, weight1, bias1) entries of rows, one row per parameter that is present in
    that order; None for the absent ones."""
    rows = iter(rows)
    return [next(rows) if here else None for here in present]


def _param_rows(dtypes, N, device, sums=None):
    """One row of N per parameter in its dtype, in one buffer when the dtypes agree (the common
    case): the fp32 rows `sums` cast (one cast for all), or, without sums, empty rows for the
    kernel to write."""
    if len(set(dtypes)) == 1:
        rows = (sums.to(dtypes[0]) if sums is not None
                else torch.empty(len(dtypes), N, dtype=dtypes[0], device=device))
        return list(rows.unbind(0))
    if sums is None:
        return [torch.empty(N, dtype=dtype, device=device) for dtype in dtypes]
    return [row.to(dtype) for row, dtype in zip(sums.unbind(0), dtypes)]


def _layer_norm_bwd(dy, x, weight, bias, eps, mean, rstd, dresidual=None, dy1=None, weight1=None,
                    bias1=None, seeds=None, dropout_p=0.0, rowscale=None, has_residual=False,
                    has_x1=False, zero_centered_weight=False, is_rms_norm=False, x_dtype=None,
                    residual_dtype=None, recompute_output=False, bwd_sums=None):
    """x: the saved pre-norm sum. Returns (dx, dw, db, dresidual_in, dx1, dw1, db1, y) with
    dresidual_in / dx1 aliasing dx when they are equal; y only with recompute_output.
    bwd_sums: the forward's zeroed sums buffer (_layer_norm_fwd(bwd_sums=True)), or None: then
    this call zeroes one (a memset before the kernel). The kernel leaves it zeroed again."""
    device = launch_device(_op_name(is_rms_norm), "x", x)
    M, N = x.shape
    if dy.shape != (M, N):
        raise ValueError(f"layer_norm_fn: the output gradient must have shape {(M, N)}, got "
                         f"{tuple(dy.shape)}")
    dy = dy if dy.stride(-1) == 1 else dy.contiguous()
    if dresidual is not None and dresidual.stride(-1) != 1:
        dresidual = dresidual.contiguous()
    if dy1 is not None and dy1.stride(-1) != 1:
        dy1 = dy1.contiguous()
    x_dtype = x_dtype or x.dtype
    residual_dtype = residual_dtype or x.dtype
    dx = torch.empty(M, N, dtype=x_dtype, device=x.device)
    # The residual's gradient is the pre-norm sum's; it needs its own buffer only when dropout,
    # rowscale or a dtype change make it differ from dx.
    store_dres = has_residual and (dropout_p > 0.0 or rowscale is not None or has_x1
                                   or residual_dtype != x_dtype)
    dresidual_in = (torch.empty(M, N, dtype=residual_dtype, device=x.device)
                    if store_dres else None)
    dx1 = torch.empty_like(dx) if has_x1 and dropout_p > 0.0 else None
    y = (torch.empty(M, N, dtype=dy.dtype, device=x.device) if recompute_output else None)
    block_n = _block_n(x, N)
    rows_per_iter, num_warps, programs, rows_per_program = _bwd_grid(x, M, block_n)
    present = (True, bias is not None, weight1 is not None, bias1 is not None)  # w, b, w1, b1
    dtypes = [t.dtype for t in (weight, bias, weight1, bias1) if t is not None]
    atomic = M > 0 and _atomic_param_grads()
    rezero_sums = False
    if atomic:
        # SUM_COPIES zeroed fp32 rows per parameter that the programs add into, and the ticket
        # counter after them (_bwd_sums_numel). The last program writes the gradients into `grads`.
        sum_copies = _bwd_sum_copies(block_n, programs)
        numel = _bwd_sums_numel(len(dtypes), sum_copies, N)
        if bwd_sums is not None:
            if bwd_sums.numel() != numel:
                raise RuntimeError(f"_layer_norm_bwd: bwd_sums has {bwd_sums.numel()} elements, "
                                   f"this backward needs {numel}")
            sums, rezero_sums = bwd_sums, True
        else:
            sums = torch.zeros(numel, dtype=torch.float32, device=x.device)
        tickets = sums[-1:].view(torch.int32)
        sums = sums[:-1].view(len(dtypes), sum_copies, N)
        grads = _param_rows(dtypes, N, x.device)
    else:
        # The per-program partial sums of every parameter gradient in one buffer, so that one
        # reduction (and one cast) finishes them all: at small sizes each extra launch costs
        # more CPU time than the kernel's GPU time.
        sums = torch.empty(len(dtypes), programs, N, dtype=torch.float32, device=x.device)
        tickets, grads, sum_copies = None, [None] * len(dtypes), 1
    dw_part, db_part, dw1_part, db1_part = _per_param(sums, present)
    dw, db, dw1, db1 = _per_param(grads, present)
    if M > 0:
        with device:
            _layer_norm_bwd_kernel[(programs,)](
                x, weight, bias, y, dy, dx, dw_part, db_part, dresidual, weight1, dy1, dx1,
                dw1_part, db1_part, dresidual_in, rowscale, seeds, mean, rstd, dw, db, dw1, db1,
                tickets,
                x.stride(0), y.stride(0) if y is not None else 0, dy.stride(0), dx.stride(0),
                dresidual.stride(0) if dresidual is not None else 0,
                dy1.stride(0) if dy1 is not None else 0,
                dx1.stride(0) if dx1 is not None else 0,
                dresidual_in.stride(0) if dresidual_in is not None else 0,
                M, N, dropout_p, rows_per_program,
                IS_RMS_NORM=is_rms_norm, BLOCK_N=block_n, ROWS_PER_ITER=rows_per_iter,
                NUM_STAGES=_pipeline_stages(_bwd_num_stages(block_n), _tile_bytes(
                    rows_per_iter, block_n, x, dy, dresidual, dy1)),
                ZERO_CENTERED_WEIGHT=zero_centered_weight,
                HAS_DRESIDUAL=dresidual is not None, STORE_DRESIDUAL=dresidual_in is not None,
                HAS_BIAS=bias is not None, HAS_DROPOUT=dropout_p > 0.0,
                HAS_ROWSCALE=rowscale is not None, HAS_DY1=dy1 is not None,
                HAS_DX1=dx1 is not None, HAS_B1=bias1 is not None,
                RECOMPUTE_OUTPUT=y is not None, ATOMIC_PARAM_GRADS=atomic,
                SUM_COPIES=sum_copies, REZERO_SUMS=rezero_sums,
                num_warps=num_warps,
            )
    else:
        sums.zero_()
    if not atomic:
        dw, db, dw1, db1 = _per_param(_param_rows(dtypes, N, x.device, sums.sum(1)), present)
    if has_residual and dresidual_in is None:
        dresidual_in = dx
    if has_x1 and dx1 is None:
        dx1 = dx
    return dx, dw, db, dresidual_in, dx1, dw1, db1, y


# --------------------------------------------------------------------------------------------
# Autograd and the public functions
# --------------------------------------------------------------------------------------------

def _rows(t):
    """(..., N) -> (M, N) with a contiguous last dimension, or None."""
    if t is None:
        return None
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def _out_rows(t, name, x_shape):
    """A caller's output buffer viewed as rows; it must be written in place, so no copies."""
    if t is None:
        return None
    if t.shape != x_shape:
        raise ValueError(f"layer_norm_fn: {name} must have the shape of x {tuple(x_shape)}, got "
                         f"{tuple(t.shape)}")
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError as error:
        raise ValueError(f"layer_norm_fn: {name} must be viewable as rows (contiguous last "
                         f"dimension)") from error


class LayerNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, residual=None, x1=None, weight1=None, bias1=None, eps=1e-6,
                dropout_p=0.0, rowscale=None, prenorm=False, residual_in_fp32=False,
                zero_centered_weight=False, is_rms_norm=False, return_dropout_mask=False,
                out_dtype=None, out=None, residual_out=None):
        x_shape = x.shape
        for name, t in (("residual", residual), ("x1", x1)):
            if t is not None and t.shape != x_shape:
                raise ValueError(f"layer_norm_fn: {name} must have the shape of x "
                                 f"{tuple(x_shape)}, got {tuple(t.shape)}")
        if x1 is not None and rowscale is not None:
            raise ValueError("layer_norm_fn: rowscale is not supported together with x1")
        x2, residual2, x12 = _rows(x), _rows(residual), _rows(x1)
        weight = weight.contiguous()
        bias, weight1, bias1 = (t.contiguous() if t is not None else None
                                for t in (bias, weight1, bias1))
        rowscale = rowscale.reshape(-1).contiguous() if rowscale is not None else None
        residual_dtype = (residual.dtype if residual is not None
                          else (torch.float32 if residual_in_fp32 else None))
        y, y1, mean, rstd, res_out, seeds, mask, mask1, bwd_sums = _layer_norm_fwd(
            x2, weight, bias, eps, residual2, x12, weight1, bias1, dropout_p=dropout_p,
            rowscale=rowscale, out_dtype=out_dtype, residual_dtype=residual_dtype,
            zero_centered_weight=zero_centered_weight, is_rms_norm=is_rms_norm,
            return_dropout_mask=return_dropout_mask, out=_out_rows(out, "out", x_shape),
            residual_out=_out_rows(residual_out, "residual_out", x_shape),
            bwd_sums=any(ctx.needs_input_grad),
        )
        ctx.save_for_backward(res_out, weight, bias, weight1, bias1, rowscale, seeds, mean, rstd,
                              bwd_sums)
        ctx.x_shape = x_shape
        ctx.eps = eps
        ctx.dropout_p = dropout_p
        ctx.is_rms_norm = is_rms_norm
        ctx.has_residual = residual is not None
        ctx.has_x1 = x1 is not None
        ctx.prenorm = prenorm
        ctx.x_dtype = x.dtype
        ctx.residual_dtype = residual.dtype if residual is not None else None
        ctx.zero_centered_weight = zero_centered_weight
        outputs = (y.view(x_shape),) + ((y1.view(x_shape),) if y1 is not None else ())
        if prenorm:
            outputs += (res_out.view(x_shape),)
        if return_dropout_mask:
            masks = tuple(m.view(x_shape) if m is not None else None for m in (mask, mask1))
            ctx.mark_non_differentiable(*(m for m in masks if m is not None))
            outputs += masks
        return outputs[0] if len(outputs) == 1 else outputs

    @staticmethod
    def backward(ctx, dy, *args):
        x, weight, bias, weight1, bias1, rowscale, seeds, mean, rstd, bwd_sums = ctx.saved_tensors
        dy = _rows(dy)
        dy1 = None
        if weight1 is not None:
            dy1, args = _rows(args[0]), args[1:]
        dresidual = _rows(args[0]) if ctx.prenorm else None
        dx, dw, db, dres_in, dx1, dw1, db1, _ = _layer_norm_bwd(
            dy, x, weight, bias, ctx.eps, mean, rstd, dresidual, dy1, weight1, bias1, seeds,
            ctx.dropout_p, rowscale, ctx.has_residual, ctx.has_x1, ctx.zero_centered_weight,
            ctx.is_rms_norm, x_dtype=ctx.x_dtype, residual_dtype=ctx.residual_dtype,
            bwd_sums=bwd_sums,
        )
        shape = ctx.x_shape
        return (
            dx.view(shape), dw, db,
            dres_in.view(shape) if ctx.has_residual else None,
            dx1.view(shape) if ctx.has_x1 else None,
            dw1, db1,
        ) + (None,) * 11


def layer_norm_fn(x, weight, bias, residual=None, x1=None, weight1=None, bias1=None, eps=1e-6,
                  dropout_p=0.0, rowscale=None, prenorm=False, residual_in_fp32=False,
                  zero_centered_weight=False, is_rms_norm=False, return_dropout_mask=False,
                  out_dtype=None, out=None, residual_out=None):
    """Returns y [, y1 (with weight1)] [, the pre-norm sum (prenorm)]
    [, dropout_mask, dropout_mask1 (return_dropout_mask; bool, True = kept, None if unused)].
    out / residual_out: buffers to write y / the pre-norm sum into."""
    return LayerNormFn.apply(x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p,
                             rowscale, prenorm, residual_in_fp32, zero_centered_weight,
                             is_rms_norm, return_dropout_mask, out_dtype, out, residual_out)


def rms_norm_fn(x, weight, bias, residual=None, x1=None, weight1=None, bias1=None, eps=1e-6,
                dropout_p=0.0, rowscale=None, prenorm=False, residual_in_fp32=False,
                zero_centered_weight=False, return_dropout_mask=False, out_dtype=None, out=None,
                residual_out=None):
    return LayerNormFn.apply(x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p,
                             rowscale, prenorm, residual_in_fp32, zero_centered_weight, True,
                             return_dropout_mask, out_dtype, out, residual_out)


class _Norm(torch.nn.Module):
    _is_rms_norm = False

    def __init__(self, hidden_size, eps=1e-5, dropout_p=0.0, zero_centered_weight=False,
                 bias=False, device=None, dtype=None):
        factory_kwargs = {"device": device, "dtype": dtype}
        super().__init__()
        self.eps = eps
        self.drop = torch.nn.Dropout(dropout_p) if dropout_p > 0.0 else None
        self.zero_centered_weight = zero_centered_weight
        self.weight = torch.nn.Parameter(torch.empty(hidden_size, **factory_kwargs))
        if bias:
            self.bias = torch.nn.Parameter(torch.empty(hidden_size, **factory_kwargs))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self):
        # With zero_centered_weight the effective weight is 1 + weight.
        (torch.nn.init.zeros_ if self.zero_centered_weight else torch.nn.init.ones_)(self.weight)
        if self.bias is not None:
            torch.nn.init.zeros_(self.bias)

    def forward(self, x, residual=None, prenorm=False, residual_in_fp32=False):
        return layer_norm_fn(
            x, self.weight, self.bias, residual=residual, eps=self.eps,
            dropout_p=self.drop.p if self.drop is not None and self.training else 0.0,
            prenorm=prenorm, residual_in_fp32=residual_in_fp32,
            zero_centered_weight=self.zero_centered_weight, is_rms_norm=self._is_rms_norm,
        )


class RMSNorm(_Norm):
    """RMSNorm(hidden_size, eps=1e-5, dropout_p=0.0, zero_centered_weight=False): no bias."""
    _is_rms_norm = True

    def __init__(self, hidden_size, eps=1e-5, dropout_p=0.0, zero_centered_weight=False,
                 device=None, dtype=None):
        super().__init__(hidden_size, eps, dropout_p, zero_centered_weight, bias=False,
                         device=device, dtype=dtype)


class LayerNorm(_Norm):
    """LayerNorm(hidden_size, eps=1e-5, dropout_p=0.0, zero_centered_weight=False) with bias."""

    def __init__(self, hidden_size, eps=1e-5, dropout_p=0.0, zero_centered_weight=False,
                 device=None, dtype=None):
        super().__init__(hidden_size, eps, dropout_p, zero_centered_weight, bias=True,
                         device=device, dtype=dtype)


class LayerNormLinearFn(torch.autograd.Function):
    """norm(x [+ residual]) followed by a linear layer; the normalised activations are not kept
    but recomputed in the backward (they would be the largest saved tensor)."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, x, norm_weight, norm_bias, linear_weight, linear_bias, residual=None,
                eps=1e-6, prenorm=False, residual_in_fp32=False, is_rms_norm=False):
        x_shape = x.shape
        if residual is not None and residual.shape != x_shape:
            raise ValueError(f"layer_norm_linear_fn: residual must have the shape of x "
                             f"{tuple(x_shape)}, got {tuple(residual.shape)}")
        x2, residual2 = _rows(x), _rows(residual)
        norm_weight = norm_weight.contiguous()
        norm_bias = norm_bias.contiguous() if norm_bias is not None else None
        residual_dtype = (residual.dtype if residual is not None
                          else (torch.float32 if residual_in_fp32 else None))
        autocast = x.is_cuda and torch.is_autocast_enabled("cuda")
        out_dtype = torch.get_autocast_dtype("cuda") if autocast else None
        y, _, mean, rstd, res_out, *_, bwd_sums = _layer_norm_fwd(
            x2, norm_weight, norm_bias, eps, residual2, out_dtype=out_dtype,
            residual_dtype=residual_dtype, is_rms_norm=is_rms_norm,
            bwd_sums=any(ctx.needs_input_grad),
        )
        linear_weight = linear_weight.to(y.dtype)
        linear_bias = linear_bias.to(y.dtype) if linear_bias is not None else None
        out = F.linear(y, linear_weight, linear_bias)
        ctx.save_for_backward(res_out, norm_weight, norm_bias, linear_weight, mean, rstd, bwd_sums)
        ctx.x_shape = x_shape
        ctx.eps = eps
        ctx.is_rms_norm = is_rms_norm
        ctx.has_residual = residual is not None
        ctx.prenorm = prenorm
        ctx.x_dtype = x.dtype
        ctx.residual_dtype = residual.dtype if residual is not None else None
        ctx.linear_bias_is_none = linear_bias is None
        out = out.view(*x_shape[:-1], out.shape[-1])
        return out if not prenorm else (out, res_out.view(x_shape))

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, dout, *args):
        x, norm_weight, norm_bias, linear_weight, mean, rstd, bwd_sums = ctx.saved_tensors
        dout = dout.reshape(-1, dout.shape[-1])
        dy = _rows(F.linear(dout, linear_weight.t()))
        dlinear_bias = None if ctx.linear_bias_is_none else dout.sum(0)
        dresidual = _rows(args[0]) if ctx.prenorm else None
        dx, dnorm_weight, dnorm_bias, dres_in, _, _, _, y = _layer_norm_bwd(
            dy, x, norm_weight, norm_bias, ctx.eps, mean, rstd, dresidual=dresidual,
            has_residual=ctx.has_residual, is_rms_norm=ctx.is_rms_norm, x_dtype=ctx.x_dtype,
            residual_dtype=ctx.residual_dtype, recompute_output=True, bwd_sums=bwd_sums,
        )
        dlinear_weight = torch.einsum("bo,bi->oi", dout, y.to(dout.dtype))
        shape = ctx.x_shape
        return (dx.view(shape), dnorm_weight, dnorm_bias, dlinear_weight, dlinear_bias,
                dres_in.view(shape) if ctx.has_residual else None, None, None, None, None)


def layer_norm_linear_fn(x, norm_weight, norm_bias, linear_weight, linear_bias, residual=None,
                         eps=1e-6, prenorm=False, residual_in_fp32=False, is_rms_norm=False):
    return LayerNormLinearFn.apply(x, norm_weight, norm_bias, linear_weight, linear_bias,
                                   residual, eps, prenorm, residual_in_fp32, is_rms_norm)
