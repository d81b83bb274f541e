"""Rotary position embedding as one Triton kernel: GPT-NeoX (halves) and GPT-J (interleaved pairs)
layouts, partial rotary dim, per-sequence position offsets, varlen batches, in place or not.

Rotation of the pair (x0, x1) at position p by angle theta:
    out0 = x0 * cos - x1 * sin,  out1 = x0 * sin + x1 * cos.
`conjugate=True` rotates by -theta (sin -> -sin): the inverse rotation, which is also the backward.
"""

from typing import Optional, Union

import torch
import triton
import triton.language as tl

from flash_attn.ops.triton.launch_device import launch_device


@triton.jit
def _rotary_kernel(
    OUT, X, COS, SIN, CU_SEQLENS, SEQLEN_OFFSETS,
    seqlen, nheads, seqlen_ro,
    stride_out_b, stride_out_m, stride_out_h, stride_out_d,
    stride_x_b, stride_x_m, stride_x_h, stride_x_d,
    stride_cs_m,
    ROTARY_DIM: tl.constexpr, HEAD_DIM: tl.constexpr,
    IS_VARLEN: tl.constexpr, OFFSETS_ARE_TENSOR: tl.constexpr,
    INTERLEAVED: tl.constexpr, CONJUGATE: tl.constexpr, COPY_TAIL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr,
):
    # One program: BLOCK_M positions x BLOCK_H heads of one sequence; cos/sin are loaded once
    # per position and shared by the heads.
    pid_m = tl.program_id(0)
    pid_b = tl.program_id(1)
    pid_h = tl.program_id(2)
    if IS_VARLEN:
        start = tl.load(CU_SEQLENS + pid_b).to(tl.int64)
        seqlen = (tl.load(CU_SEQLENS + pid_b + 1) - start).to(tl.int32)
        X += start * stride_x_m
        OUT += start * stride_out_m
    else:
        X += pid_b.to(tl.int64) * stride_x_b
        OUT += pid_b.to(tl.int64) * stride_out_b
    if pid_m * BLOCK_M >= seqlen:
        return
    if OFFSETS_ARE_TENSOR:
        offset = tl.load(SEQLEN_OFFSETS + pid_b)
    else:
        offset = SEQLEN_OFFSETS

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rh = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    rk = tl.arange(0, BLOCK_K)
    half: tl.constexpr = ROTARY_DIM // 2

    # Positions past the table rotate by 0 (cos 1, sin 0), as in flash-attn.
    pos = rm + offset
    cs_off = pos[:, None].to(tl.int64) * stride_cs_m + rk[None, :]
    cs_mask = (pos[:, None] < seqlen_ro) & (rk[None, :] < half)
    cos = tl.load(COS + cs_off, mask=cs_mask, other=1.0).to(tl.float32)[:, None, :]
    sin = tl.load(SIN + cs_off, mask=cs_mask, other=0.0).to(tl.float32)[:, None, :]
    if CONJUGATE:
        sin = -sin

    row_mask = ((rm < seqlen)[:, None] & (rh < nheads)[None, :])[:, :, None]
    x_row = X + rm[:, None, None].to(tl.int64) * stride_x_m + rh[None, :, None] * stride_x_h
    o_row = OUT + rm[:, None, None].to(tl.int64) * stride_out_m + rh[None, :, None] * stride_out_h
    if INTERLEAVED:
        # Load the pairs as one contiguous run, then split even/odd in registers (coalesced).
        rd = tl.arange(0, 2 * BLOCK_K)[None, None, :]
        mask = row_mask & (rd < ROTARY_DIM)
        x = tl.load(x_row + rd * stride_x_d, mask=mask, other=0.0).to(tl.float32)
        x0, x1 = tl.split(tl.reshape(x, (BLOCK_M, BLOCK_H, BLOCK_K, 2)))
        o0 = x0 * cos - x1 * sin
        o1 = x0 * sin + x1 * cos
        o = tl.reshape(tl.join(o0, o1), (BLOCK_M, BLOCK_H, 2 * BLOCK_K))
        tl.store(o_row + rd * stride_out_d, o.to(OUT.dtype.element_ty), mask=mask)
    else:
        rk3 = rk[None, None, :]
        mask = row_mask & (rk3 < half)
        x0 = tl.load(x_row + rk3 * stride_x_d, mask=mask, other=0.0).to(tl.float32)
        x1 = tl.load(x_row + (rk3 + half) * stride_x_d, mask=mask, other=0.0).to(tl.float32)
        o0 = x0 * cos - x1 * sin
        o1 = x0 * sin + x1 * cos
        tl.store(o_row + rk3 * stride_out_d, o0.to(OUT.dtype.element_ty), mask=mask)
        tl.store(o_row + (rk3 + half) * stride_out_d, o1.to(OUT.dtype.element_ty), mask=mask)
    if COPY_TAIL:
        # Dimensions past rotary_dim pass through unchanged; doing it here saves a second pass.
        rt = ROTARY_DIM + tl.arange(0, BLOCK_T)[None, None, :]
        mask = row_mask & (rt < HEAD_DIM)
        t = tl.load(x_row + rt * stride_x_d, mask=mask)
        tl.store(o_row + rt * stride_out_d, t, mask=mask)


# flash-attn 2.8's name of the kernel.
rotary_kernel = _rotary_kernel

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _fail(name, expected, got):
    raise ValueError(f"apply_rotary: {name} must be {expected}, got {got}")


def _rotary_dims(x, cos, cu_seqlens, max_seqlen):
    """(batch, seqlen, nheads, headdim, rotary_dim) of arguments that passed the checks."""
    if cu_seqlens is None:
        batch, seqlen, nheads, headdim = x.shape
    else:
        batch, seqlen = cu_seqlens.shape[0] - 1, max_seqlen
        _, nheads, headdim = x.shape
    return batch, seqlen, nheads, headdim, 2 * cos.shape[1]


def _check_rotary_args(x, cos, sin, seqlen_offsets, cu_seqlens, max_seqlen, out):
    """All argument checks of apply_rotary."""
    if not isinstance(x, torch.Tensor) or x.dtype not in _FLOAT_DTYPES:
        _fail("x", "a float16, bfloat16 or float32 tensor", getattr(x, "dtype", type(x).__name__))
    if cu_seqlens is None:
        if x.dim() != 4:
            _fail("x", "4-D (batch, seqlen, nheads, headdim)", f"shape {tuple(x.shape)}")
    else:
        if x.dim() != 3:
            _fail("x", "3-D (total_seqlen, nheads, headdim) with cu_seqlens",
                  f"shape {tuple(x.shape)}")
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64):
            _fail("cu_seqlens", "a 1-D int32 tensor (batch + 1,)",
                  f"{cu_seqlens.dtype} of shape {tuple(cu_seqlens.shape)}")
        if cu_seqlens.device != x.device:
            _fail("cu_seqlens", f"on {x.device} like x", cu_seqlens.device)
        if not isinstance(max_seqlen, int):
            _fail("max_seqlen", "an int when cu_seqlens is given", repr(max_seqlen))
    for name, t in (("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.dtype not in _FLOAT_DTYPES:
            _fail(name, "a 2-D float tensor (seqlen_ro, rotary_dim / 2)",
                  f"{getattr(t, 'dtype', type(t).__name__)} of shape "
                  f"{tuple(getattr(t, 'shape', ()))}")
        if t.device != x.device:
            _fail(name, f"on {x.device} like x", t.device)
    if sin.shape != cos.shape or sin.dtype != cos.dtype:
        _fail("sin", f"the shape and dtype of cos ({tuple(cos.shape)}, {cos.dtype})",
              f"{tuple(sin.shape)}, {sin.dtype}")
    batch, seqlen, _, headdim, rotary_dim = _rotary_dims(x, cos, cu_seqlens, max_seqlen)
    seqlen_ro = cos.shape[0]
    if rotary_dim > headdim:
        _fail("cos", f"(seqlen_ro, rotary_dim / 2) with rotary_dim <= headdim ({headdim})",
              f"rotary_dim {rotary_dim}")
    if seqlen_ro < seqlen:
        _fail("cos", f"at least seqlen ({seqlen}) rows", seqlen_ro)
    if isinstance(seqlen_offsets, torch.Tensor):
        if (seqlen_offsets.shape != (batch,)
                or seqlen_offsets.dtype not in (torch.int32, torch.int64)):
            _fail("seqlen_offsets", f"an int or an int32/int64 tensor of shape ({batch},)",
                  f"{seqlen_offsets.dtype} of shape {tuple(seqlen_offsets.shape)}")
        if seqlen_offsets.device != x.device:
            _fail("seqlen_offsets", f"on {x.device} like x", seqlen_offsets.device)
    elif not isinstance(seqlen_offsets, int):
        _fail("seqlen_offsets", "an int or an int tensor of shape (batch,)",
              type(seqlen_offsets).__name__)
    elif seqlen_offsets + seqlen > seqlen_ro:
        _fail("seqlen_offsets", f"at most seqlen_ro - seqlen ({seqlen_ro} - {seqlen})",
              seqlen_offsets)
    if out is not None and (out.shape != x.shape or out.dtype != x.dtype
                            or out.device != x.device):
        _fail("out", f"{x.dtype} of shape {tuple(x.shape)} on {x.device}",
              f"{out.dtype} of shape {tuple(out.shape)} on {out.device}")


def _strides4(t, varlen):
    # Varlen tensors have no batch axis: the kernel offsets rows through cu_seqlens instead.
    return (0,) + tuple(t.stride()) if varlen else tuple(t.stride())


def _launch(out, x, cos, sin, seqlen_offsets, cu_seqlens, max_seqlen, interleaved, conjugate,
            block_m=None, block_h=None, num_warps=None):
    """Runs the kernel on arguments that passed _check_rotary_args; out may be x."""
    batch, seqlen, nheads, headdim, rotary_dim = _rotary_dims(x, cos, cu_seqlens, max_seqlen)
    device = launch_device("apply_rotary", "x", x)
    if x.numel() == 0 or rotary_dim == 0 and out.data_ptr() == x.data_ptr():
        return out
    cos, sin = cos.contiguous(), sin.contiguous()
    varlen = cu_seqlens is not None
    block_k = triton.next_power_of_2(max(rotary_dim // 2, 1))
    tail = headdim - rotary_dim
    copy_tail = tail > 0 and out.data_ptr() != x.data_ptr()
    # About 4k elements per program: enough bytes in flight per SM without spilling registers.
    if block_h is None:
        block_h = min(triton.next_power_of_2(nheads), 16)
    if block_m is None:
        block_m = max(1, min(4096 // (block_h * 2 * block_k), triton.next_power_of_2(seqlen), 64))
    if num_warps is None:
        num_warps = 4 if block_m * block_h * block_k <= 2048 else 8
    grid = (triton.cdiv(seqlen, block_m), batch, triton.cdiv(nheads, block_h))
    offsets_are_tensor = isinstance(seqlen_offsets, torch.Tensor)
    with device:
        _rotary_kernel[grid](
            out, x, cos, sin, cu_seqlens, seqlen_offsets,
            seqlen, nheads, cos.shape[0],
            *_strides4(out, varlen), *_strides4(x, varlen),
            cos.stride(0),
            ROTARY_DIM=rotary_dim, HEAD_DIM=headdim,
            IS_VARLEN=varlen, OFFSETS_ARE_TENSOR=offsets_are_tensor,
            INTERLEAVED=interleaved, CONJUGATE=conjugate, COPY_TAIL=copy_tail,
            BLOCK_M=block_m, BLOCK_H=block_h, BLOCK_K=block_k,
            BLOCK_T=triton.next_power_of_2(max(tail, 1)),
            num_warps=num_warps,
        )
    return out


# The kernel as torch.library ops (out of place, in place, into out), which is what torch.compile
# sees: one opaque op whose writes the schema declares, so that AOTAutograd functionalises it,
# also inside the in-place autograd Functions of flash_attn.layers.rotary. Without them Dynamo
# traces into the launcher, whose data_ptr() comparisons break the graph in the middle of those
# Functions, and into the kernel (on CPU, the Triton interpreter, which fails on fake tensors).
# Library.define, not torch.library.custom_op: custom_op's Python autograd and version-counter
# kernels added 15 us (out of place) to 40 us (in place) to an eager call on a CPU VM, these ops
# about 5 us. So the ops that write a tensor bump its version counter themselves (autograd does
# not see the kernel's writes), and apply_rotary calls them under no_grad (no autograd formula).
# The offsets travel as an optional tensor plus an int: a schema has no Union.

_library = torch.library.Library("flash_attn", "FRAGMENT")
_OPTION_ARGS = ("Tensor? seqlen_offsets_tensor, SymInt seqlen_offset, Tensor? cu_seqlens, "
            "SymInt? max_seqlen, bool interleaved, bool conjugate")
for _schema in (
        f"_apply_rotary(Tensor x, Tensor cos, Tensor sin, {_OPTION_ARGS}) -> Tensor",
        f"_apply_rotary_inplace(Tensor(a!) x, Tensor cos, Tensor sin, {_OPTION_ARGS}) -> ()",
        f"_apply_rotary_out(Tensor x, Tensor cos, Tensor sin, Tensor(a!) out, {_OPTION_ARGS})"
        " -> ()"):
    _library.define(_schema, tags=(torch.Tag.pt2_compliant_tag,))


def _offsets(seqlen_offsets_tensor, seqlen_offset):
    return seqlen_offset if seqlen_offsets_tensor is None else seqlen_offsets_tensor


def _apply_rotary_op(x, cos, sin, seqlen_offsets_tensor, seqlen_offset, cu_seqlens, max_seqlen,
                     interleaved, conjugate):
    return _launch(torch.empty_like(x), x, cos, sin,
                   _offsets(seqlen_offsets_tensor, seqlen_offset), cu_seqlens, max_seqlen,
                   interleaved, conjugate)


def _apply_rotary_inplace_op(x, cos, sin, seqlen_offsets_tensor, seqlen_offset, cu_seqlens,
                             max_seqlen, interleaved, conjugate):
    _launch(x, x, cos, sin, _offsets(seqlen_offsets_tensor, seqlen_offset), cu_seqlens,
            max_seqlen, interleaved, conjugate)
    torch.autograd.graph.increment_version(x)


def _apply_rotary_out_op(x, cos, sin, out, seqlen_offsets_tensor, seqlen_offset, cu_seqlens,
                         max_seqlen, interleaved, conjugate):
    _launch(out, x, cos, sin, _offsets(seqlen_offsets_tensor, seqlen_offset), cu_seqlens,
            max_seqlen, interleaved, conjugate)
    torch.autograd.graph.increment_version(out)


for _name, _impl, _fake in (
        ("_apply_rotary", _apply_rotary_op, lambda x, *args: torch.empty_like(x)),  # as the op
        ("_apply_rotary_inplace", _apply_rotary_inplace_op, lambda *args: None),
        ("_apply_rotary_out", _apply_rotary_out_op, lambda *args: None)):
    _library.impl(_name, _impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"flash_attn::{_name}", _fake, lib=_library)


def apply_rotary(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    seqlen_offsets: Union[int, torch.Tensor] = 0,
    cu_seqlens: Optional[torch.Tensor] = None,
    max_seqlen: Optional[int] = None,
    interleaved: bool = False,
    inplace: bool = False,
    conjugate: bool = False,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Rotates the first rotary_dim features of every head of x by its position.

    x: (batch, seqlen, nheads, headdim), or (total_seqlen, nheads, headdim) with cu_seqlens
        (batch + 1,) int32 and max_seqlen.
    cos, sin: (seqlen_ro, rotary_dim / 2), rotary_dim <= headdim; features past rotary_dim are
        passed through. Token i of sequence b sits at position i + seqlen_offsets[b]
        (seqlen_offsets: int or (batch,) int tensor, as in kv-cache decoding).
    interleaved: rotate pairs (0, 1), (2, 3), ... (GPT-J) instead of the two halves (GPT-NeoX).
    inplace: write into x. conjugate: rotate by minus the angle (the backward).
    out: optional preallocated output (same shape and dtype as x; not an alias of x).
    Returns the rotated tensor, of x's shape. No autograd here: flash_attn.layers.rotary has it.
    Traceable by torch.compile (as the flash_attn::_apply_rotary* ops).
    """
    _check_rotary_args(x, cos, sin, seqlen_offsets, cu_seqlens, max_seqlen,
                       None if inplace else out)
    if isinstance(seqlen_offsets, torch.Tensor):
        offsets = (seqlen_offsets, 0)
    else:
        offsets = (None, seqlen_offsets)
    # max_seqlen means something only with cu_seqlens.
    layout = (cu_seqlens, max_seqlen if cu_seqlens is not None else None, interleaved, conjugate)
    with torch.no_grad():
        if inplace:
            torch.ops.flash_attn._apply_rotary_inplace(x, cos, sin, *offsets, *layout)
            return x
        if out is None:
            return torch.ops.flash_attn._apply_rotary(x, cos, sin, *offsets, *layout)
        torch.ops.flash_attn._apply_rotary_out(x, cos, sin, out, *offsets, *layout)
        return out


def apply_rotary_ref(x, cos, sin, seqlen_offsets=0, cu_seqlens=None, max_seqlen=None,
                     interleaved=False, conjugate=False):
    """Plain-PyTorch apply_rotary (for tests), computed in the dtype of x: pass float32 inputs
    for an exact reference, low-precision ones to see what that precision alone costs. The one
    PyTorch rotary is layers.rotary's (imported here, since that module imports this one)."""
    from flash_attn.layers.rotary import apply_rotary_emb_torch

    del max_seqlen  # the packed rows' positions come from cu_seqlens alone
    return apply_rotary_emb_torch(x, cos.to(x.dtype), sin.to(x.dtype), interleaved=interleaved,
                                  seqlen_offsets=seqlen_offsets, cu_seqlens=cu_seqlens,
                                  conjugate=conjugate)
