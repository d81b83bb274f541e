"""Fused softmax cross-entropy for large vocabularies, in Triton.

The forward reads the logits once, one program per (row, vocabulary block), each storing its
block's max and sum of exponentials; a small second kernel folds a row's blocks into its
log-sum-exp and stores only per-row scalars (loss, z-loss, lse).
The backward recomputes softmax from the logits and the saved lse, so no probability buffer
the size of the logits ever exists; with inplace_backward the gradient overwrites the logits.

Loss of one row with label y, logits x (after logit_scale), C classes, smoothing e, z-loss c:
    lse - (1 - e) * x_y - e * mean(x) + c * lse^2,   and 0 where y == ignore_index;
NaN (and a NaN gradient) where y is any other label outside [0, C).
Vocab-parallel (process_group): rank r holds classes [r * n, (r + 1) * n). Each rank computes the
lse of its slice and the part of the loss it owns (-(1 - e) x_y if it holds y, -e * sum(x) / C);
the lse pieces are gathered and combined, the partial losses summed, then lse (and z-loss) added.
"""

from typing import Optional, Tuple

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from flash_attn.ops.triton.launch_device import launch_device


@triton.jit
def _aligned_row(row_off, ALIGN: tl.constexpr):
    """(base, shift): the row starts at base + shift with base a multiple of ALIGN elements
    (16 bytes), so that blocks taken from base are vector-aligned even when the vocabulary size
    is not a multiple of 8 (GPT-2's 50257)."""
    if ALIGN > 1:
        shift = row_off % ALIGN
        return tl.multiple_of(row_off - shift, ALIGN), shift
    else:
        return row_off, 0


@triton.jit
def _label_out_of_range(label, total_classes):
    # The callers let ignore_index win: it usually lies outside [0, total_classes) (-100).
    return (label < 0) | (label >= total_classes)


@triton.jit
def _cross_entropy_fwd_block_kernel(
    BLOCK_MAX, BLOCK_SUMEXP, BLOCK_SUMX, LOGITS,
    n_cols, stride_logits_row, logit_scale,
    HAS_SMOOTHING: tl.constexpr, BLOCK: tl.constexpr, ALIGN: tl.constexpr,
):
    # One vocabulary block of one row: its max, its sum of exp(x - max) and (smoothing) its sum,
    # at (row, block) of the (rows, blocks) partials.
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    base, shift = _aligned_row(row * stride_logits_row, ALIGN)
    end = n_cols + shift  # the row is [shift, end) from base
    start = block * BLOCK
    j = start + tl.arange(0, BLOCK)
    if (start >= shift) & (start + BLOCK <= end):
        # Interior block: no mask, so the loads vectorize.
        x = tl.load(LOGITS + base + j).to(tl.float32) * logit_scale
        valid = j >= 0
    else:
        valid = (j >= shift) & (j < end)
        x = tl.load(LOGITS + base + j, mask=valid, other=0.0).to(tl.float32) * logit_scale
        x = tl.where(valid, x, float("-inf"))
    m = tl.max(x, axis=0)
    # A block past the row's end (or of -inf logits) has max -inf and sum 0, not NaN.
    s = tl.sum(tl.exp(x - tl.where(m == float("-inf"), 0.0, m)), axis=0)
    out = row * tl.num_programs(1) + block
    tl.store(BLOCK_MAX + out, m)
    tl.store(BLOCK_SUMEXP + out, s)
    if HAS_SMOOTHING:
        tl.store(BLOCK_SUMX + out, tl.sum(tl.where(valid, x, 0.0), axis=0))


@triton.jit
def _cross_entropy_fwd_combine_kernel(
    LOSS, Z_LOSS, LSE, LOGITS, LABELS, BLOCK_MAX, BLOCK_SUMEXP, BLOCK_SUMX,
    n_rows, n_cols, n_blocks, stride_logits_row,
    smoothing, logit_scale, lse_square_scale, ignore_index, total_classes, class_start,
    HAS_SMOOTHING: tl.constexpr, SPLIT: tl.constexpr, ROWS: tl.constexpr, BLOCKS: tl.constexpr,
):
    # ROWS rows: their blocks' (max, sum of exp) folded into lse, then the loss terms.
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    in_rows = rows < n_rows
    blocks = tl.arange(0, BLOCKS)
    mask = in_rows[:, None] & (blocks < n_blocks)[None, :]
    at = rows[:, None] * n_blocks + blocks[None, :]
    m = tl.load(BLOCK_MAX + at, mask=mask, other=float("-inf"))
    m_row = tl.max(m, axis=1)
    m_safe = tl.where(m_row == float("-inf"), 0.0, m_row)
    s = tl.load(BLOCK_SUMEXP + at, mask=mask, other=0.0)
    sumexp = tl.sum(s * tl.exp(m - m_safe[:, None]), axis=1)
    lse = m_safe + tl.log(tl.where(in_rows, sumexp, 1.0))  # rows past the end: nothing to log
    tl.store(LSE + rows, lse, mask=in_rows)

    label = tl.load(LABELS + rows, mask=in_rows, other=ignore_index)
    label_idx = label - class_start
    owns_label = in_rows & (label_idx >= 0) & (label_idx < n_cols)
    row_off = rows * stride_logits_row
    x_label = tl.load(LOGITS + row_off + label_idx, mask=owns_label, other=0.0).to(tl.float32)
    x_label = tl.where(owns_label, x_label * logit_scale, 0.0)
    # Vocab-parallel: the lse and z-loss terms are added after the pieces are combined.
    loss = tl.zeros((ROWS,), dtype=tl.float32) if SPLIT else lse
    if HAS_SMOOTHING:
        sum_x = tl.sum(tl.load(BLOCK_SUMX + at, mask=mask, other=0.0), axis=1)
        loss = loss - (1.0 - smoothing) * x_label - smoothing * sum_x / total_classes
    else:
        loss = loss - x_label
    z_loss = tl.zeros((ROWS,), dtype=tl.float32) if SPLIT else lse_square_scale * lse * lse
    ignored = label == ignore_index
    # A label outside the whole vocabulary picks no class: NaN rather than the plausible lse,
    # and in the kernel, so that nothing waits on the host. Vocab-parallel, every rank sees the
    # same label, so the NaN survives the sum over ranks.
    loss = tl.where(_label_out_of_range(label, total_classes), float("nan"), loss + z_loss)
    tl.store(LOSS + rows, tl.where(ignored, 0.0, loss), mask=in_rows)
    tl.store(Z_LOSS + rows, tl.where(ignored, 0.0, z_loss), mask=in_rows)


@triton.jit
def _softmax_grad(x, c, dloss, lse, label_idx, smoothing, logit_scale, lse_square_scale,
                  total_classes, HAS_SMOOTHING: tl.constexpr):
    p = tl.exp(x.to(tl.float32) * logit_scale - lse)
    # d(lse)/dx = p, and d(c * lse^2)/dx = 2 c lse p.
    g = p * (1.0 + 2.0 * lse_square_scale * lse)
    is_label = c == label_idx
    if HAS_SMOOTHING:
        g = g - tl.where(is_label, 1.0 - smoothing, 0.0) - smoothing / total_classes
    else:
        g = g - tl.where(is_label, 1.0, 0.0)
    return g * (dloss * logit_scale)


@triton.jit
def _cross_entropy_bwd_kernel(
    DLOGITS, DLOSS, LOGITS, LSE, LABELS,
    n_cols, stride_logits_row, stride_dloss,
    smoothing, logit_scale, lse_square_scale, ignore_index, total_classes, class_start,
    HAS_SMOOTHING: tl.constexpr, BLOCK: tl.constexpr, ALIGN: tl.constexpr,
):
    # dlogits has the strides of logits (and the same alignment), so one offset serves both.
    row = tl.program_id(0).to(tl.int64)
    base, shift = _aligned_row(row * stride_logits_row, ALIGN)
    end = n_cols + shift
    start = tl.program_id(1) * BLOCK
    j = start + tl.arange(0, BLOCK)
    label = tl.load(LABELS + row)
    dloss = tl.load(DLOSS + row * stride_dloss).to(tl.float32)
    # The NaN loss of an out-of-range label has a NaN gradient, in every column of its row.
    dloss = tl.where(_label_out_of_range(label, total_classes), float("nan"), dloss)
    dloss = tl.where(label == ignore_index, 0.0, dloss)
    lse = tl.load(LSE + row)
    label_idx = label - class_start + shift
    if (start >= shift) & (start + BLOCK <= end):
        x = tl.load(LOGITS + base + j)
        g = _softmax_grad(x, j, dloss, lse, label_idx, smoothing, logit_scale, lse_square_scale,
                          total_classes, HAS_SMOOTHING)
        tl.store(DLOGITS + base + j, g.to(DLOGITS.dtype.element_ty))
    else:
        valid = (j >= shift) & (j < end)
        x = tl.load(LOGITS + base + j, mask=valid, other=0.0)
        g = _softmax_grad(x, j, dloss, lse, label_idx, smoothing, logit_scale, lse_square_scale,
                          total_classes, HAS_SMOOTHING)
        tl.store(DLOGITS + base + j, g.to(DLOGITS.dtype.element_ty), mask=valid)


def _fail(name, expected, got):
    raise ValueError(f"cross_entropy_loss: {name} must be {expected}, got {got}")


def _check_cross_entropy_args(logits, labels, label_smoothing, logit_scale, lse_square_scale):
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.dtype not in (
            torch.float16, torch.bfloat16, torch.float32):
        _fail("logits", "a 2-D (batch, vocab_size) float16, bfloat16 or float32 tensor",
              f"{getattr(logits, 'dtype', type(logits).__name__)} of shape "
              f"{tuple(getattr(logits, 'shape', ()))}")
    if (not isinstance(labels, torch.Tensor) or labels.shape != logits.shape[:1]
            or labels.dtype not in (torch.int32, torch.int64)):
        _fail("labels", f"an int64 or int32 tensor of shape ({logits.shape[0]},)",
              f"{getattr(labels, 'dtype', type(labels).__name__)} of shape "
              f"{tuple(getattr(labels, 'shape', ()))}")
    if labels.device != logits.device:
        _fail("labels", f"on {logits.device} like logits", labels.device)
    if not 0.0 <= label_smoothing <= 1.0:
        _fail("label_smoothing", "in [0, 1]", label_smoothing)
    if not logit_scale > 0.0:
        _fail("logit_scale", "> 0", logit_scale)
    if not lse_square_scale >= 0.0:
        _fail("lse_square_scale", ">= 0", lse_square_scale)


def _align(*tensors):
    """Elements per 16-byte vector when every tensor starts 16-byte aligned, else 1."""
    if all(t.data_ptr() % 16 == 0 for t in tensors):
        return 16 // tensors[0].element_size()
    return 1


def _vocab_blocks(n_cols, align, block, num_warps, max_block):
    """(block, num_warps, blocks per row) of a kernel with one program per (row, vocabulary
    block): block defaults to the row's power of two up to max_block, num_warps to 4 up to 1024
    elements a block and 8 beyond. The blocks tile [0, n_cols + shift) from each row's aligned
    base (shift < align)."""
    if block is None:
        block = min(triton.next_power_of_2(n_cols), max_block)
    if num_warps is None:
        num_warps = 4 if block <= 1024 else 8
    return block, num_warps, triton.cdiv(n_cols + align - 1, block)


def _forward_launch(logits, labels, losses, z_losses, lse, smoothing, logit_scale,
                    lse_square_scale, ignore_index, total_classes, class_start, split,
                    block=None, num_warps=None):
    n_rows, n_cols = logits.shape
    # Every (row, vocabulary block) is a program of its own, as in the backward: one pass over
    # the logits with the whole GPU's loads in flight (a program streaming a whole row keeps too
    # few); a second, small kernel folds each row's blocks into lse and the loss.
    align = _align(logits)
    block, num_warps, n_blocks = _vocab_blocks(n_cols, align, block, num_warps, max_block=4096)
    partials = torch.empty(3 if smoothing > 0.0 else 2, n_rows, n_blocks, dtype=torch.float32,
                           device=logits.device)
    block_max, block_sumexp = partials[0], partials[1]
    block_sumx = partials[2] if smoothing > 0.0 else block_max  # unread without smoothing
    blocks_p2 = triton.next_power_of_2(n_blocks)
    rows = max(1, min(64, 4096 // blocks_p2))
    with launch_device("cross_entropy_loss", "logits", logits):
        _cross_entropy_fwd_block_kernel[(n_rows, n_blocks)](
            block_max, block_sumexp, block_sumx, logits,
            n_cols, logits.stride(0), logit_scale,
            HAS_SMOOTHING=smoothing > 0.0, BLOCK=block, ALIGN=align, num_warps=num_warps,
        )
        _cross_entropy_fwd_combine_kernel[(triton.cdiv(n_rows, rows),)](
            losses, z_losses, lse, logits, labels, block_max, block_sumexp, block_sumx,
            n_rows, n_cols, n_blocks, logits.stride(0),
            smoothing, logit_scale, lse_square_scale, ignore_index, total_classes, class_start,
            HAS_SMOOTHING=smoothing > 0.0, SPLIT=split, ROWS=rows, BLOCKS=blocks_p2, num_warps=4,
        )


def _backward_launch(dlogits, dlosses, logits, lse, labels, smoothing, logit_scale,
                     lse_square_scale, ignore_index, total_classes, class_start,
                     block=None, num_warps=None):
    n_rows, n_cols = logits.shape
    assert dlogits.stride() == logits.stride()
    # 1024-wide blocks, 4 warps: the fastest of the H200 sweep (benchmark_cross_entropy.py, 2.34
    # against 2.55 ms for 4096 / 8 warps at vocab 128256).
    align = _align(logits, dlogits)
    block, num_warps, n_blocks = _vocab_blocks(n_cols, align, block, num_warps, max_block=1024)
    grid = (n_rows, n_blocks)
    with launch_device("cross_entropy_loss", "logits", logits):
        _cross_entropy_bwd_kernel[grid](
            dlogits, dlosses, logits, lse, labels,
            n_cols, logits.stride(0), dlosses.stride(0),
            smoothing, logit_scale, lse_square_scale, ignore_index, total_classes, class_start,
            HAS_SMOOTHING=smoothing > 0.0, BLOCK=block, ALIGN=align, num_warps=num_warps,
        )


def _combine_vocab_parallel(losses, lse_local, labels, lse_square_scale, ignore_index,
                            process_group):
    """Global lse from every rank's piece, total loss from every rank's partial loss."""
    world_size = dist.get_world_size(process_group)
    pieces = [torch.empty_like(lse_local) for _ in range(world_size)]
    dist.all_gather(pieces, lse_local, group=process_group)
    dist.all_reduce(losses, op=dist.ReduceOp.SUM, group=process_group)
    lse = torch.logsumexp(torch.stack(pieces), dim=0)
    ignored = labels == ignore_index
    z_losses = (lse_square_scale * lse.square()).masked_fill_(ignored, 0.0)
    losses = (losses + lse + z_losses).masked_fill_(ignored, 0.0)
    return losses, z_losses, lse


class CrossEntropyLossFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, smoothing=0.0, logit_scale=1.0, lse_square_scale=0.0,
                ignore_index=-100, inplace_backward=False, process_group=None):
        _check_cross_entropy_args(logits, labels, smoothing, logit_scale, lse_square_scale)
        if logits.stride(-1) != 1 or (logits.shape[0] > 1 and logits.stride(0) < logits.shape[1]):
            logits = logits.contiguous()  # the kernels need unit-stride, non-overlapping rows
        labels = labels.contiguous()
        world_size = 1 if process_group is None else dist.get_world_size(process_group)
        rank = 0 if process_group is None else dist.get_rank(process_group)
        n_rows, n_cols = logits.shape
        split = world_size > 1
        total_classes, class_start = world_size * n_cols, rank * n_cols
        losses = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
        z_losses = torch.empty_like(losses)
        lse = torch.empty_like(losses)
        if n_rows > 0:
            _forward_launch(logits, labels, losses, z_losses, lse, float(smoothing),
                            float(logit_scale), float(lse_square_scale), ignore_index,
                            total_classes, class_start, split)
        if split:
            losses, z_losses, lse = _combine_vocab_parallel(
                losses, lse, labels, float(lse_square_scale), ignore_index, process_group)
        ctx.save_for_backward(logits, lse, labels)
        ctx.mark_non_differentiable(z_losses)
        ctx.args = (float(smoothing), float(logit_scale), float(lse_square_scale), ignore_index,
                    total_classes, class_start)
        ctx.inplace_backward = inplace_backward
        return losses, z_losses

    @staticmethod
    def backward(ctx, grad_losses, grad_z_losses):
        del grad_z_losses  # z_losses are returned for logging; their gradient is in losses'
        logits, lse, labels = ctx.saved_tensors
        # Same strides as logits, so that the kernel addresses both with one offset.
        dlogits = logits if ctx.inplace_backward else torch.empty_strided(
            logits.shape, logits.stride(), dtype=logits.dtype, device=logits.device)
        if logits.shape[0] > 0:
            _backward_launch(dlogits, grad_losses, logits, lse, labels, *ctx.args)
        return dlogits, None, None, None, None, None, None, None


# flash-attn's name for the autograd Function (the nn.Module lives in flash_attn.losses)
CrossEntropyLoss = CrossEntropyLossFunction


def cross_entropy_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    label_smoothing: float = 0.0,
    logit_scale: float = 1.0,
    lse_square_scale: float = 0.0,
    ignore_index=-100,
    inplace_backward: bool = False,
    process_group: Optional["dist.ProcessGroup"] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-row softmax cross-entropy.

    logits: (batch, vocab_size), or this rank's (batch, vocab_size / world_size) slice with
        process_group (rank r holds the r-th contiguous slice; every rank the same size).
    labels: (batch,) int64/int32 class indices over the full vocabulary, [0, vocab_size) (also
        with process_group: a label in another rank's slice is a normal label).
    label_smoothing: weight e of the uniform target: loss = lse - (1 - e) x_y - e * mean(x).
    logit_scale: logits are multiplied by it first.
    lse_square_scale: z-loss weight c: c * lse^2 is added to the loss and also returned alone.
    ignore_index: rows with this label get loss 0 and gradient 0.
    Any other label outside the full vocabulary gets a NaN loss and a NaN gradient row (checked
    in the kernel, without a host sync); its z-loss, which does not depend on the label, is
    still returned.
    inplace_backward: the backward writes the gradient into logits (saves a logits-sized buffer;
        logits must not be needed afterwards).
    Returns (losses, z_losses), both (batch,) float32; only losses carries a gradient.
    """
    return CrossEntropyLossFunction.apply(logits, labels, label_smoothing, logit_scale,
                                          lse_square_scale, ignore_index, inplace_backward,
                                          process_group)


def cross_entropy_loss_ref(logits, labels, label_smoothing=0.0, logit_scale=1.0,
                           lse_square_scale=0.0, ignore_index=-100):
    """Plain-PyTorch (losses, z_losses), in float32, for tests and benchmarks."""
    x = logits.float() * logit_scale
    lse = torch.logsumexp(x, dim=-1)
    ignored = labels == ignore_index
    target = labels.masked_fill(ignored, 0).long()
    x_label = x.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    losses = lse - (1.0 - label_smoothing) * x_label - label_smoothing * x.mean(dim=-1)
    z_losses = lse_square_scale * lse.square()
    losses = (losses + z_losses).masked_fill(ignored, 0.0)
    return losses, z_losses.masked_fill(ignored, 0.0)
