"""The attention entry points: argument checks, head-dim padding, autograd and torch.library ops.

Data flows one way: a public function normalises its arguments and calls an autograd Function,
which calls a `torch.ops.flash_attn.*` custom op, which calls the `flash_attn_2_cuda` extension.
The module-level names of flash-attn 2.8's interface (the private ops `_flash_attn_forward` & co.
with their signatures, `_wrapped_*`, `maybe_contiguous`, `round_multiple`, `_get_block_size_n`,
`USE_TRITON_ROCM`, `flash_attn_gpu`) are here with the same meaning, for code that imports them.

Set FLASH_ATTN_CHECK_INPUTS=1 to validate the varlen offsets (cu_seqlens_q/k against the token
counts, max_seqlen_q/k and block_table) on the host before every varlen call. It costs a device
sync per call, so it is off by default; without it inconsistent offsets are not detected.
"""

import os
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from flash_attn._native import load_extension

MAX_HEAD_DIM = 256
# Paged K/V (block_table): pages of any multiple of 16 rows.
PAGE_BLOCK_MULTIPLE = 16

# flash-attn 2.8 can run on ROCm through a Triton backend chosen by this flag; this package has
# only the CUDA kernels, so it is always False here.
USE_TRITON_ROCM = False


def _cuda_ext():
    return load_extension("flash_attn_2_cuda")


def __getattr__(name):
    # flash-attn binds the extension at import as `flash_attn_gpu`; here it loads on first use, so
    # that importing this module never fails on a machine where it is not built.
    if name == "flash_attn_gpu":
        return _cuda_ext()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def maybe_contiguous(x):
    """x with a contiguous last dimension (what the kernels read), or None."""
    return x.contiguous() if x is not None and x.stride(-1) != 1 else x


def round_multiple(x, m):
    return (x + m - 1) // m * m


# flash-attn 2.8's names for the torch.library decorators its ops are registered with.
_torch_custom_op_wrapper = torch.library.custom_op
_torch_register_fake_wrapper = torch.library.register_fake


# ----------------------------------------------------------------------------------------------
# Argument checks: one function for every entry point, run before any kernel.
# ----------------------------------------------------------------------------------------------


def _fail(name, expected, got):
    raise ValueError(f"flash_attn: {name} must be {expected}, got {got}")


def _check_attention_args(q, k, v, *, varlen, cu_seqlens_q=None, cu_seqlens_k=None,
                          max_seqlen_q=0, max_seqlen_k=0, alibi_slopes=None, block_table=None,
                          dropout_p=0.0, window_size=(-1, -1), softcap=0.0,
                          names=("q", "k", "v"), kv_batch_like_q=True, check_devices=True):
    """Checks every argument of the public functions before any kernel runs (ValueError naming
    the argument, as the caller calls q, k, v: `names`); the binding repeats the checks it needs
    for direct calls. kv_batch_like_q=False: k/v may have more batch rows (a KV cache)."""
    q_name, k_name, v_name = names
    for name, t in ((q_name, q), (k_name, k), (v_name, v)):
        if not isinstance(t, torch.Tensor):
            _fail(name, "a torch.Tensor", type(t).__name__)
        if t.dtype not in (torch.float16, torch.bfloat16):
            _fail(name, "float16 or bfloat16", t.dtype)
    for name, t in ((k_name, k), (v_name, v)):
        if t.dtype != q.dtype:
            _fail(name, f"the same dtype as q ({q.dtype})", t.dtype)
    rank = 3 if varlen else 4
    layout = "(total, heads, head_dim)" if varlen else "(batch, seqlen, heads, head_dim)"
    if block_table is not None:
        rank_k, layout_k = 4, "(num_blocks, page_block_size, heads_k, head_dim)"
    else:
        rank_k, layout_k = rank, layout
    if q.dim() != rank:
        _fail(q_name, f"{rank}-D {layout}", f"shape {tuple(q.shape)}")
    for name, t in ((k_name, k), (v_name, v)):
        if t.dim() != rank_k:
            _fail(name, f"{rank_k}-D {layout_k}", f"shape {tuple(t.shape)}")
    head_dim, num_heads = q.shape[-1], q.shape[-2]
    if head_dim > MAX_HEAD_DIM:
        _fail(q_name, f"of head dim at most {MAX_HEAD_DIM}", f"head dim {head_dim}")
    if k.shape[-1] != head_dim or v.shape[-1] != head_dim:
        _fail(f"{k_name} and {v_name}", f"of the same head dim as {q_name} ({head_dim})",
              f"{k.shape[-1]} and {v.shape[-1]}")
    if k.shape != v.shape:
        _fail(v_name, f"the same shape as {k_name} {tuple(k.shape)}", f"{tuple(v.shape)}")
    num_heads_k = k.shape[-2]
    if num_heads % num_heads_k != 0:
        _fail(k_name, f"a number of heads dividing the {num_heads} query heads", num_heads_k)
    if (not varlen and block_table is None and kv_batch_like_q and k.shape[0] != q.shape[0]):
        _fail(k_name, f"of batch size {q.shape[0]} like {q_name}", k.shape[0])
    for name, t in ((q_name, q), (k_name, k), (v_name, v)):
        if t.stride(-1) != 1:
            _fail(name, "contiguous in its last dimension", f"stride {t.stride()}")
    if varlen:
        for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
            if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != 1:
                _fail(name, "a 1-D torch.int32 tensor of batch+1 offsets",
                      getattr(t, "dtype", type(t).__name__))
        if cu_seqlens_q.numel() != cu_seqlens_k.numel():
            _fail("cu_seqlens_k", f"of length {cu_seqlens_q.numel()} like cu_seqlens_q",
                  cu_seqlens_k.numel())
        for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
            if isinstance(value, bool) or int(value) != value or value < 0:
                _fail(name, "an int >= 0", value)
    if block_table is not None:
        if block_table.dtype != torch.int32 or block_table.dim() != 2:
            _fail("block_table", "a 2-D torch.int32 tensor (batch, max_blocks_per_seq)",
                  f"{block_table.dtype} of shape {tuple(block_table.shape)}")
        if k.shape[1] == 0 or k.shape[1] % PAGE_BLOCK_MULTIPLE != 0:
            _fail(k_name, f"paged with a page_block_size that is a multiple of {PAGE_BLOCK_MULTIPLE}",
                  k.shape[1])
        if not varlen and block_table.shape[0] != q.shape[0]:
            _fail("block_table", f"of {q.shape[0]} rows (one per batch entry)", block_table.shape[0])
        if cu_seqlens_k is not None and block_table.shape[0] != cu_seqlens_k.numel() - 1:
            _fail("block_table", f"of {cu_seqlens_k.numel() - 1} rows (one per sequence)",
                  block_table.shape[0])
    if alibi_slopes is not None:
        if alibi_slopes.dtype != torch.float32:
            _fail("alibi_slopes", "float32", alibi_slopes.dtype)
        if alibi_slopes.shape[-1:] != (num_heads,) or alibi_slopes.dim() not in (1, 2):
            _fail("alibi_slopes", f"of shape ({num_heads},) or (batch, {num_heads})",
                  tuple(alibi_slopes.shape))
    if not 0.0 <= dropout_p < 1.0:
        _fail("dropout_p", "in [0, 1)", dropout_p)
    if not softcap >= 0.0:  # also rejects NaN
        _fail("softcap", ">= 0", softcap)
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or any(isinstance(w, bool) or int(w) != w or w < -1 for w in window_size)):
        _fail("window_size", "a pair (left, right) of ints >= -1 (-1: unbounded)", window_size)
    tensors = [(k_name, k), (v_name, v), ("cu_seqlens_q", cu_seqlens_q),
               ("cu_seqlens_k", cu_seqlens_k), ("alibi_slopes", alibi_slopes),
               ("block_table", block_table)]
    if varlen and _host_checks_enabled():
        _check_varlen_offsets(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                              block_table)
    if check_devices:
        _check_devices(q, tensors, q_name)


def _check_devices(q, tensors, q_name="q"):
    """q on a CUDA device and every (name, tensor or None) of `tensors` on q's device."""
    if not q.is_cuda:
        _fail(q_name, "on a CUDA device", q.device)
    for name, t in tensors:
        if t is not None and t.device != q.device:
            _fail(name, f"on the same device as {q_name} ({q.device})", t.device)


def _host_checks_enabled():
    return os.environ.get("FLASH_ATTN_CHECK_INPUTS", "0").strip().lower() in ("1", "true", "yes", "on")


def _check_varlen_offsets(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                          block_table):
    """FLASH_ATTN_CHECK_INPUTS=1: the offsets agree with the tensors (one host copy of each)."""
    paged = block_table is not None
    lengths = {}
    for name, cu, total, max_seqlen, max_name in (
            ("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q, "max_seqlen_q"),
            ("cu_seqlens_k", cu_seqlens_k, None if paged else k.shape[0], max_seqlen_k,
             "max_seqlen_k")):
        offsets = cu.tolist()
        if offsets[0] != 0:
            _fail(name, "offsets starting at 0", offsets[:4])
        lengths[name] = [end - start for start, end in zip(offsets, offsets[1:])]
        if any(n < 0 for n in lengths[name]):
            _fail(name, "non-decreasing offsets", offsets)
        if total is not None and offsets[-1] > total:
            _fail(name, f"offsets within the {total} tokens of its tensor",
                  f"last offset {offsets[-1]}")
        longest = max(lengths[name], default=0)
        if longest > max_seqlen:
            _fail(max_name, f"at least the longest sequence of {name} ({longest})", max_seqlen)
    if paged:
        capacity = block_table.shape[1] * k.shape[1]
        for length in lengths["cu_seqlens_k"]:
            if length > capacity:
                _fail("cu_seqlens_k", f"sequences of at most {capacity} keys (block_table's "
                      f"{block_table.shape[1]} blocks of {k.shape[1]})", length)
        _check_used_blocks(block_table, lengths["cu_seqlens_k"], k.shape[0], k.shape[1])


def _check_used_blocks(block_table, lengths, num_blocks, page_block_size):
    """FLASH_ATTN_CHECK_INPUTS=1: the blocks each row's `lengths` keys occupy exist."""
    for row, length in zip(block_table.tolist(), lengths):
        used = row[: -(-length // page_block_size)]
        if any(not 0 <= block < num_blocks for block in used):
            _fail("block_table", f"block indices in [0, {num_blocks}) for the blocks a "
                  "sequence uses", used)


# ----------------------------------------------------------------------------------------------
# torch.library custom ops: what torch.compile sees. Each calls the extension once.
# ----------------------------------------------------------------------------------------------


# The signatures (names, order, defaults) and results are flash-attn 2.8's, so code that calls
# these private ops directly (ring / context-parallel attention libraries do) runs unchanged.


@torch.library.custom_op("flash_attn::_flash_attn_forward", mutates_args=(), device_types="cuda")
def _flash_attn_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float, softmax_scale: float,
    causal: bool, window_size_left: int, window_size_right: int, softcap: float,
    alibi_slopes: Optional[torch.Tensor], return_softmax: bool,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, v = (maybe_contiguous(t) for t in (q, k, v))
    out, softmax_lse, S_dmask, rng_state = _cuda_ext().fwd(
        q, k, v, None, alibi_slopes, dropout_p, softmax_scale, causal,
        window_size_left, window_size_right, softcap, return_softmax, None,
    )
    return out, softmax_lse, S_dmask, rng_state


@_flash_attn_forward.register_fake
def _(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap,
      alibi_slopes, return_softmax):
    batch, seqlen_q, num_heads, _ = q.shape
    seqlen_k = k.shape[1]
    out = torch.empty_like(maybe_contiguous(q))  # as the binding allocates it
    softmax_lse = q.new_empty((batch, num_heads, seqlen_q), dtype=torch.float32)
    shape_p = ((batch, num_heads, round_multiple(seqlen_q, 128), round_multiple(seqlen_k, 128))
               if return_softmax else (0,))
    return out, softmax_lse, q.new_empty(shape_p), q.new_empty((2,), dtype=torch.int64)


@torch.library.custom_op("flash_attn::_flash_attn_varlen_forward", mutates_args=(),
                         device_types="cuda")
def _flash_attn_varlen_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, dropout_p: float,
    softmax_scale: float, causal: bool, window_size_left: int = -1, window_size_right: int = -1,
    softcap: float = 0.0, alibi_slopes: Optional[torch.Tensor] = None,
    return_softmax: bool = False, block_table: Optional[torch.Tensor] = None,
    leftpad_k: Optional[torch.Tensor] = None, seqused_k: Optional[torch.Tensor] = None,
    zero_tensors: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, v = (maybe_contiguous(t) for t in (q, k, v))
    out, softmax_lse, S_dmask, rng_state = _cuda_ext().varlen_fwd(
        q, k, v, None, cu_seqlens_q, cu_seqlens_k, seqused_k, leftpad_k, block_table,
        alibi_slopes, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, zero_tensors, causal,
        window_size_left, window_size_right, softcap, return_softmax, None,
    )
    return out, softmax_lse, S_dmask, rng_state


@_flash_attn_varlen_forward.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
      causal, window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None,
      return_softmax=False, block_table=None, leftpad_k=None, seqused_k=None, zero_tensors=False):
    total_q, num_heads, _ = q.shape
    batch = cu_seqlens_q.numel() - 1
    out = torch.empty_like(maybe_contiguous(q))  # as the binding allocates it
    softmax_lse = q.new_empty((num_heads, total_q), dtype=torch.float32)
    shape_p = ((batch, num_heads, round_multiple(max_seqlen_q, 128),
                round_multiple(max_seqlen_k, 128)) if return_softmax else (0,))
    return out, softmax_lse, q.new_empty(shape_p), q.new_empty((2,), dtype=torch.int64)


@torch.library.custom_op("flash_attn::_flash_attn_backward", mutates_args=("dq", "dk", "dv"),
                         device_types="cuda")
def _flash_attn_backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    softmax_lse: torch.Tensor, dq: Optional[torch.Tensor], dk: Optional[torch.Tensor],
    dv: Optional[torch.Tensor], dropout_p: float, softmax_scale: float, causal: bool,
    window_size_left: int, window_size_right: int, softcap: float,
    alibi_slopes: Optional[torch.Tensor], deterministic: bool,
    rng_state: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    dout, q, k, v, out = (maybe_contiguous(t) for t in (dout, q, k, v, out))
    _, _, _, softmax_d = _cuda_ext().bwd(
        dout, q, k, v, out, softmax_lse, dq, dk, dv, alibi_slopes, dropout_p, softmax_scale,
        causal, window_size_left, window_size_right, softcap, deterministic, None, rng_state,
    )
    return softmax_d


@_flash_attn_backward.register_fake
def _(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
      window_size_left, window_size_right, softcap, alibi_slopes, deterministic, rng_state=None):
    return torch.empty_like(softmax_lse)


@torch.library.custom_op("flash_attn::_flash_attn_varlen_backward", mutates_args=("dq", "dk", "dv"),
                         device_types="cuda")
def _flash_attn_varlen_backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    softmax_lse: torch.Tensor, dq: Optional[torch.Tensor], dk: Optional[torch.Tensor],
    dv: Optional[torch.Tensor], cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int, max_seqlen_k: int, dropout_p: float, softmax_scale: float, causal: bool,
    window_size_left: int, window_size_right: int, softcap: float,
    alibi_slopes: Optional[torch.Tensor], deterministic: bool,
    rng_state: Optional[torch.Tensor] = None, zero_tensors: bool = False,
) -> torch.Tensor:
    dout, q, k, v, out = (maybe_contiguous(t) for t in (dout, q, k, v, out))
    _, _, _, softmax_d = _cuda_ext().varlen_bwd(
        dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, alibi_slopes,
        max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, zero_tensors, causal,
        window_size_left, window_size_right, softcap, deterministic, None, rng_state,
    )
    return softmax_d


@_flash_attn_varlen_backward.register_fake
def _(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
      max_seqlen_k, dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap,
      alibi_slopes, deterministic, rng_state=None, zero_tensors=False):
    return torch.empty_like(softmax_lse)


# flash-attn 2.8's autograd Functions call the ops through these (the torch.ops handles on
# PyTorch >= 2.4, which this package requires).
_wrapped_flash_attn_forward = torch.ops.flash_attn._flash_attn_forward
_wrapped_flash_attn_varlen_forward = torch.ops.flash_attn._flash_attn_varlen_forward
_wrapped_flash_attn_backward = torch.ops.flash_attn._flash_attn_backward
_wrapped_flash_attn_varlen_backward = torch.ops.flash_attn._flash_attn_varlen_backward


# ----------------------------------------------------------------------------------------------
# Shared forward/backward plumbing of the autograd Functions.
# ----------------------------------------------------------------------------------------------


def _pad_head_dim(*tensors):
    """The kernels take head dims that are multiples of 8; pad (and later slice) the rest."""
    head_dim = tensors[0].shape[-1]
    if head_dim % 8 == 0:
        return tensors
    pad = 8 - head_dim % 8
    return tuple(None if t is None else F.pad(t, [0, pad]) for t in tensors)


def _normalize_window(window_size, causal):
    left, right = window_size
    return int(left), (0 if causal else int(right))


class _FlashAttnBase(torch.autograd.Function):
    """Forward and backward of every non-kvcache entry point; subclasses only say how inputs
    and gradients are packed."""

    @staticmethod
    def _run(ctx, q, k, v, varlen_args, dropout_p, softmax_scale, causal, window_size, softcap,
             alibi_slopes, deterministic, return_softmax, is_grad_enabled, grads_needed):
        head_dim = q.shape[-1]
        if softmax_scale is None:
            softmax_scale = head_dim ** (-0.5)
        window_left, window_right = _normalize_window(window_size, causal)
        q_p, k_p, v_p = _pad_head_dim(q, k, v)
        if varlen_args is None:
            out, softmax_lse, S_dmask, rng_state = torch.ops.flash_attn._flash_attn_forward(
                q_p, k_p, v_p, dropout_p, softmax_scale, causal, window_left, window_right,
                softcap, alibi_slopes, return_softmax and dropout_p > 0,
            )
            seqlens = ()
        else:
            cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table = varlen_args
            out, softmax_lse, S_dmask, rng_state = torch.ops.flash_attn._flash_attn_varlen_forward(
                q_p, k_p, v_p, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                softmax_scale, causal, window_left, window_right, softcap, alibi_slopes,
                return_softmax and dropout_p > 0, block_table,
            )
            seqlens = (cu_seqlens_q, cu_seqlens_k)
        if is_grad_enabled and grads_needed:
            ctx.save_for_backward(q_p, k_p, v_p, out, softmax_lse, rng_state, *seqlens)
            ctx.settings = dict(dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                                window_size=(window_left, window_right), softcap=softcap,
                                alibi_slopes=alibi_slopes, deterministic=deterministic,
                                varlen=varlen_args is not None, head_dim=head_dim,
                                max_seqlens=None if varlen_args is None else varlen_args[2:4],
                                paged=varlen_args is not None and varlen_args[4] is not None)
        out = out[..., :head_dim]
        return (out, softmax_lse, S_dmask) if return_softmax else out

    @staticmethod
    def _grads(ctx, dout, dq=None, dk=None, dv=None):
        """dq, dk, dv of the saved forward, in the padded head dim of its inputs. dq/dk/dv may be
        views into a packed gradient (written in place, no copy)."""
        st = ctx.settings
        if st["paged"]:
            raise NotImplementedError("flash_attn: no backward through a paged K/V cache (block_table)")
        q, k, v, out, softmax_lse, rng_state, *seqlens = ctx.saved_tensors
        (dout,) = _pad_head_dim(dout)
        if dout.stride(-1) != 1:
            dout = dout.contiguous()
        dq = torch.empty_like(q) if dq is None else dq
        dk = torch.empty_like(k) if dk is None else dk
        dv = torch.empty_like(v) if dv is None else dv
        common = (st["dropout_p"], st["softmax_scale"], st["causal"], *st["window_size"],
                  st["softcap"], st["alibi_slopes"], st["deterministic"], rng_state)
        if st["varlen"]:
            torch.ops.flash_attn._flash_attn_varlen_backward(
                dout, q, k, v, out, softmax_lse, dq, dk, dv, *seqlens, *st["max_seqlens"], *common)
        else:
            torch.ops.flash_attn._flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv,
                                                      *common)
        return dq, dk, dv

    @staticmethod
    def _unpacked(ctx, dout):
        head_dim = ctx.settings["head_dim"]
        return tuple(g[..., :head_dim] for g in _FlashAttnBase._grads(ctx, dout))

    @staticmethod
    def _packed(ctx, dout, dim, first):
        """The gradients of the unpacked inputs (the first `first` of q, k, v) and of the packed
        one (the rest, stacked along dim). Without head-dim padding the kernel writes straight into
        views of the packed buffer, so no copy is made."""
        head_dim = ctx.settings["head_dim"]
        if head_dim % 8 != 0:
            grads = _FlashAttnBase._unpacked(ctx, dout)
            return grads[:first] + (torch.stack(grads[first:], dim=dim),)
        member = ctx.saved_tensors[first]  # every member of the packed input has its shape
        shape = list(member.shape)
        shape.insert(dim, 3 - first)
        packed = member.new_empty(shape)
        grads = _FlashAttnBase._grads(ctx, dout, *([None] * first), *packed.unbind(dim))
        return grads[:first] + (packed,)


class FlashAttnFunc(_FlashAttnBase):
    @staticmethod
    def forward(ctx, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                alibi_slopes, deterministic, return_softmax, is_grad_enabled):
        needs = any(t.requires_grad for t in (q, k, v))
        return _FlashAttnBase._run(ctx, q, k, v, None, dropout_p, softmax_scale, causal,
                                   window_size, softcap, alibi_slopes, deterministic,
                                   return_softmax, is_grad_enabled, needs)

    @staticmethod
    def backward(ctx, dout, *_):
        return _FlashAttnBase._unpacked(ctx, dout) + (None,) * 9


class FlashAttnQKVPackedFunc(_FlashAttnBase):
    @staticmethod
    def forward(ctx, qkv, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                deterministic, return_softmax, is_grad_enabled):
        q, k, v = qkv.unbind(dim=2)
        return _FlashAttnBase._run(ctx, q, k, v, None, dropout_p, softmax_scale, causal,
                                   window_size, softcap, alibi_slopes, deterministic,
                                   return_softmax, is_grad_enabled, qkv.requires_grad)

    @staticmethod
    def backward(ctx, dout, *_):
        return _FlashAttnBase._packed(ctx, dout, dim=2, first=0) + (None,) * 9


class FlashAttnKVPackedFunc(_FlashAttnBase):
    @staticmethod
    def forward(ctx, q, kv, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                deterministic, return_softmax, is_grad_enabled):
        k, v = kv.unbind(dim=2)
        needs = q.requires_grad or kv.requires_grad
        return _FlashAttnBase._run(ctx, q, k, v, None, dropout_p, softmax_scale, causal,
                                   window_size, softcap, alibi_slopes, deterministic,
                                   return_softmax, is_grad_enabled, needs)

    @staticmethod
    def backward(ctx, dout, *_):
        return _FlashAttnBase._packed(ctx, dout, dim=2, first=1) + (None,) * 9


class FlashAttnVarlenFunc(_FlashAttnBase):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                return_softmax, block_table, is_grad_enabled):
        needs = any(t.requires_grad for t in (q, k, v))
        varlen_args = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table)
        return _FlashAttnBase._run(ctx, q, k, v, varlen_args, dropout_p, softmax_scale, causal,
                                   window_size, softcap, alibi_slopes, deterministic,
                                   return_softmax, is_grad_enabled, needs)

    @staticmethod
    def backward(ctx, dout, *_):
        return _FlashAttnBase._unpacked(ctx, dout) + (None,) * 14


class FlashAttnVarlenQKVPackedFunc(_FlashAttnBase):
    @staticmethod
    def forward(ctx, qkv, cu_seqlens, max_seqlen, dropout_p, softmax_scale, causal, window_size,
                softcap, alibi_slopes, deterministic, return_softmax, is_grad_enabled):
        q, k, v = qkv.unbind(dim=1)
        varlen_args = (cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, None)
        return _FlashAttnBase._run(ctx, q, k, v, varlen_args, dropout_p, softmax_scale, causal,
                                   window_size, softcap, alibi_slopes, deterministic,
                                   return_softmax, is_grad_enabled, qkv.requires_grad)

    @staticmethod
    def backward(ctx, dout, *_):
        return _FlashAttnBase._packed(ctx, dout, dim=1, first=0) + (None,) * 11


class FlashAttnVarlenKVPackedFunc(_FlashAttnBase):
    @staticmethod
    def forward(ctx, q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                return_softmax, is_grad_enabled):
        k, v = kv.unbind(dim=1)
        needs = q.requires_grad or kv.requires_grad
        varlen_args = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, None)
        return _FlashAttnBase._run(ctx, q, k, v, varlen_args, dropout_p, softmax_scale, causal,
                                   window_size, softcap, alibi_slopes, deterministic,
                                   return_softmax, is_grad_enabled, needs)

    @staticmethod
    def backward(ctx, dout, *_):
        return _FlashAttnBase._packed(ctx, dout, dim=1, first=1) + (None,) * 13


# ----------------------------------------------------------------------------------------------
# Public functions (flash-attn 2.x signatures).
# ----------------------------------------------------------------------------------------------


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False):
    """qkv: (batch, seqlen, 3, nheads, headdim). Returns out (batch, seqlen, nheads, headdim),
    plus (softmax_lse, S_dmask) when return_attn_probs."""
    if not isinstance(qkv, torch.Tensor) or qkv.dim() != 5 or qkv.shape[2] != 3:
        _fail("qkv", "a (batch, seqlen, 3, nheads, headdim) tensor", getattr(qkv, "shape", qkv))
    q, k, v = qkv.unbind(dim=2)
    _check_attention_args(q, k, v, varlen=False, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                          window_size=window_size, softcap=softcap)
    return FlashAttnQKVPackedFunc.apply(qkv, dropout_p, softmax_scale, causal, window_size,
                                        softcap, alibi_slopes, deterministic, return_attn_probs,
                                        torch.is_grad_enabled())


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_attn_probs=False):
    """q: (batch, seqlen_q, nheads, headdim), kv: (batch, seqlen_k, 2, nheads_k, headdim)."""
    if not isinstance(kv, torch.Tensor) or kv.dim() != 5 or kv.shape[2] != 2:
        _fail("kv", "a (batch, seqlen_k, 2, nheads_k, headdim) tensor", getattr(kv, "shape", kv))
    k, v = kv.unbind(dim=2)
    _check_attention_args(q, k, v, varlen=False, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                          window_size=window_size, softcap=softcap)
    return FlashAttnKVPackedFunc.apply(q, kv, dropout_p, softmax_scale, causal, window_size,
                                       softcap, alibi_slopes, deterministic, return_attn_probs,
                                       torch.is_grad_enabled())


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False):
    """Exact attention softmax(q k^T * softmax_scale) v.

    q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_k, headdim), nheads
    divisible by nheads_k (GQA/MQA). causal aligns the mask to the bottom-right corner;
    window_size (left, right) keeps keys in [i + s_k - s_q - left, i + s_k - s_q + right];
    alibi_slopes (nheads,) or (batch, nheads) float32 adds -slope * |i + s_k - s_q - j|;
    softcap > 0 applies softcap * tanh(score / softcap). Returns out (batch, seqlen_q, nheads,
    headdim), plus softmax_lse (batch, nheads, seqlen_q) and S_dmask when return_attn_probs
    (S_dmask holds the probabilities, negated where dropped, only when dropout_p > 0; as in
    flash-attn it is an empty tensor otherwise).
    """
    _check_attention_args(q, k, v, varlen=False, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                          window_size=window_size, softcap=softcap)
    return FlashAttnFunc.apply(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                               alibi_slopes, deterministic, return_attn_probs,
                               torch.is_grad_enabled())


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0,
                                     softmax_scale=None, causal=False, window_size=(-1, -1),
                                     softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """qkv: (total, 3, nheads, headdim); cu_seqlens: (batch + 1,) int32."""
    if not isinstance(qkv, torch.Tensor) or qkv.dim() != 4 or qkv.shape[1] != 3:
        _fail("qkv", "a (total, 3, nheads, headdim) tensor", getattr(qkv, "shape", qkv))
    q, k, v = qkv.unbind(dim=1)
    _check_attention_args(q, k, v, varlen=True, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
                          max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen,
                          alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                          window_size=window_size, softcap=softcap)
    return FlashAttnVarlenQKVPackedFunc.apply(qkv, cu_seqlens, max_seqlen, dropout_p,
                                              softmax_scale, causal, window_size, softcap,
                                              alibi_slopes, deterministic, return_attn_probs,
                                              torch.is_grad_enabled())


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, dropout_p=0.0, softmax_scale=None,
                                    causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False,
                                    return_attn_probs=False):
    """q: (total_q, nheads, headdim); kv: (total_k, 2, nheads_k, headdim)."""
    if not isinstance(kv, torch.Tensor) or kv.dim() != 4 or kv.shape[1] != 2:
        _fail("kv", "a (total_k, 2, nheads_k, headdim) tensor", getattr(kv, "shape", kv))
    k, v = kv.unbind(dim=1)
    _check_attention_args(q, k, v, varlen=True, cu_seqlens_q=cu_seqlens_q,
                          cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                          max_seqlen_k=max_seqlen_k, alibi_slopes=alibi_slopes,
                          dropout_p=dropout_p, window_size=window_size, softcap=softcap)
    return FlashAttnVarlenKVPackedFunc.apply(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                             max_seqlen_k, dropout_p, softmax_scale, causal,
                                             window_size, softcap, alibi_slopes, deterministic,
                                             return_attn_probs, torch.is_grad_enabled())


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None, deterministic=False,
                           return_attn_probs=False, block_table=None):
    """Attention over a batch of sequences of different lengths, concatenated along dim 0.

    q: (total_q, nheads, headdim); k, v: (total_k, nheads_k, headdim), or with block_table
    (batch, max_blocks) int32 a paged cache (num_blocks, page_block_size, nheads_k, headdim).
    cu_seqlens_q/k: (batch + 1,) int32 offsets. softmax_lse is (nheads, total_q).
    """
    _check_attention_args(q, k, v, varlen=True, cu_seqlens_q=cu_seqlens_q,
                          cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                          max_seqlen_k=max_seqlen_k, alibi_slopes=alibi_slopes,
                          block_table=block_table, dropout_p=dropout_p, window_size=window_size,
                          softcap=softcap)
    return FlashAttnVarlenFunc.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                     max_seqlen_k, dropout_p, softmax_scale, causal, window_size,
                                     softcap, alibi_slopes, deterministic, return_attn_probs,
                                     block_table, torch.is_grad_enabled())


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None,
                            block_table=None, softmax_scale=None, causal=False,
                            window_size=(-1, -1), softcap=0.0, rotary_interleaved=True,
                            alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    """Attention of q over a KV cache, appending new keys first: decoding and chunked prefill.

    q: (batch, seqlen_q, nheads, headdim), headdim a multiple of 8 (at most 256).
    k_cache, v_cache: (batch_cache, seqlen_cache, nheads_k, headdim), or with block_table
        (batch, max_blocks) int32 a paged cache (num_blocks, page_block_size, nheads_k, headdim),
        page_block_size any multiple of 16. nheads divisible by nheads_k (GQA/MQA).
    k, v: optional (batch, seqlen_new, nheads_k, headdim): written into the cache in place at
        positions cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1, after rotary.
    rotary_cos, rotary_sin: optional (seqlen_ro, rotary_dim / 2), seqlen_ro at least the cache
        length; need k and v. New keys are rotated at their cache positions; q at positions
        cache_seqlens[b] + i when causal or local, else every query at cache_seqlens[b].
        rotary_interleaved: rotate pairs (0, 1), (2, 3), ... instead of the two halves.
    cache_seqlens: int or (batch,) int32: keys already in the cache (0 if None).
    cache_batch_idx: optional (batch,) int32: the cache row of each batch entry (not paged).
    cache_leftpad: optional (batch,) int32: the cache row's keys start there (left padding).
    causal / window_size / softcap / alibi_slopes: as in flash_attn_func, with the mask aligned to
        the bottom-right corner of (seqlen_q, keys of the entry).
    num_splits: CTAs sharing one (query block, head)'s key range (split-KV); 0 chooses from the
        GPU's occupancy, 1 disables splitting.
    Returns out (batch, seqlen_q, nheads, headdim), plus softmax_lse (batch, nheads, seqlen_q)
    with return_softmax_lse. No backward.
    """
    cache_seqlens = _check_kvcache_args(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin,
                                        cache_seqlens, cache_batch_idx, cache_leftpad,
                                        block_table, causal, window_size, softcap, alibi_slopes,
                                        num_splits)
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** (-0.5)
    window_left, window_right = _normalize_window(window_size, causal)
    local = window_left >= 0 or window_right >= 0
    if rotary_cos is not None:
        q = _rotate_queries(q, rotary_cos, rotary_sin, cache_seqlens, rotary_interleaved,
                            per_token=causal or local)
    seqlens_k = cache_seqlens
    if k is not None:
        if rotary_cos is not None:
            from flash_attn.ops.triton.rotary import apply_rotary

            k = apply_rotary(k, rotary_cos, rotary_sin, seqlen_offsets=cache_seqlens,
                             interleaved=rotary_interleaved)
        _append_to_cache(k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table)
        seqlens_k = cache_seqlens + k.shape[1]
    batch, seqlen_q, num_heads, head_dim = q.shape
    num_heads_k = k_cache.shape[2]
    # One query against a GQA group: the group's heads become its rows (seqlen_q = group size,
    # heads = nheads_k), so each K/V tile is read once per KV head. Needs masks and biases that
    # are the same for every row: no window, no ALiBi (causal is void with one query).
    swap = seqlen_q == 1 and num_heads > num_heads_k and not local and alibi_slopes is None
    if swap:
        group = num_heads // num_heads_k
        q = q.reshape(batch, num_heads_k, group, head_dim).transpose(1, 2)
        causal, window_right = False, -1
    out, softmax_lse = torch.ops.flash_attn._flash_attn_kvcache_forward(
        q, k_cache, v_cache, seqlens_k, cache_batch_idx, cache_leftpad, block_table, alibi_slopes,
        softmax_scale, causal, window_left, window_right, softcap, num_splits)
    if swap:
        out = out.transpose(1, 2).reshape(batch, 1, num_heads, head_dim)
        softmax_lse = softmax_lse.reshape(batch, num_heads, 1)  # (b, h_k, group): head-major
    return (out, softmax_lse) if return_softmax_lse else out


@torch.library.custom_op("flash_attn::_flash_attn_kvcache_forward", mutates_args=(),
                         device_types="cuda")
def _flash_attn_kvcache_forward(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seqlens_k: torch.Tensor,
    cache_batch_idx: Optional[torch.Tensor], cache_leftpad: Optional[torch.Tensor],
    block_table: Optional[torch.Tensor], alibi_slopes: Optional[torch.Tensor],
    softmax_scale: float, causal: bool, window_size_left: int, window_size_right: int,
    softcap: float, num_splits: int,
) -> Tuple[torch.Tensor, torch.Tensor]:
    out, softmax_lse = _cuda_ext().fwd_kvcache(
        q, k_cache, v_cache, seqlens_k, cache_batch_idx, cache_leftpad, block_table, alibi_slopes,
        None, softmax_scale, causal, window_size_left, window_size_right, softcap, num_splits)
    return out, softmax_lse


@_flash_attn_kvcache_forward.register_fake
def _(q, k_cache, v_cache, seqlens_k, cache_batch_idx, cache_leftpad, block_table, alibi_slopes,
      softmax_scale, causal, window_size_left, window_size_right, softcap, num_splits):
    batch, seqlen_q, num_heads, _ = q.shape
    return (torch.empty_like(q),
            q.new_empty((batch, num_heads, seqlen_q), dtype=torch.float32))


def _check_kvcache_args(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                        cache_batch_idx, cache_leftpad, block_table, causal, window_size, softcap,
                        alibi_slopes, num_splits):
    """Every argument check of flash_attn_with_kvcache; returns cache_seqlens as a (batch,) int32
    tensor."""
    paged = block_table is not None
    _check_attention_args(q, k_cache, v_cache, varlen=False, alibi_slopes=alibi_slopes,
                          block_table=block_table, window_size=window_size, softcap=softcap,
                          names=("q", "k_cache", "v_cache"), kv_batch_like_q=False,
                          check_devices=False)
    batch, _, _, head_dim = q.shape
    num_heads_k = k_cache.shape[2]
    if head_dim % 8 != 0:
        _fail("q", "of a head dim that is a multiple of 8 (the cache cannot be padded in place)",
              head_dim)
    capacity = block_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]
    if (k is None) != (v is None):
        _fail("k and v", "given together", f"k {'None' if k is None else 'given'}, v "
              f"{'None' if v is None else 'given'}")
    if k is not None:
        shape = (batch, k.shape[1] if k.dim() == 4 else -1, num_heads_k, head_dim)
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4 or tuple(t.shape) != shape:
                _fail(name, f"(batch, seqlen_new, nheads_k, headdim) = {shape}",
                      f"shape {tuple(getattr(t, 'shape', ()))}")
            if t.dtype != q.dtype:
                _fail(name, f"{q.dtype} like q", t.dtype)
    if rotary_cos is not None or rotary_sin is not None:
        if k is None:
            _fail("rotary_cos", "given with the new k and v it rotates", "no k")
        for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
            if not isinstance(t, torch.Tensor) or t.dim() != 2 or 2 * t.shape[1] > head_dim:
                _fail(name, f"a 2-D (seqlen_ro, rotary_dim / 2) tensor, rotary_dim <= {head_dim}",
                      f"{getattr(t, 'shape', t)}")
        if rotary_cos.shape != rotary_sin.shape:
            _fail("rotary_sin", f"of rotary_cos's shape {tuple(rotary_cos.shape)}",
                  tuple(rotary_sin.shape))
        if rotary_cos.shape[0] < capacity:
            _fail("rotary_cos", f"at least the cache's {capacity} positions long",
                  rotary_cos.shape[0])
    new = 0 if k is None else k.shape[1]
    if cache_seqlens is None:
        cache_seqlens = 0
    given_int = isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool)
    if given_int and not 0 <= cache_seqlens <= capacity - new:
        _fail("cache_seqlens", f"in [0, {capacity - new}]", cache_seqlens)
    for name, t, shape in (("cache_seqlens", None if given_int else cache_seqlens, (batch,)),
                           ("cache_batch_idx", cache_batch_idx, (batch,)),
                           ("cache_leftpad", cache_leftpad, (batch,))):
        if t is not None and (not isinstance(t, torch.Tensor) or t.dtype != torch.int32
                              or tuple(t.shape) != shape):
            _fail(name, f"an int32 tensor of shape {shape}",
                  f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
    if paged and cache_batch_idx is not None:
        _fail("cache_batch_idx", "None with block_table (the table maps batch entries)", "a tensor")
    if not paged and cache_batch_idx is None and k_cache.shape[0] < batch:
        _fail("k_cache", f"at least q's {batch} batch rows", k_cache.shape[0])
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 0:
        _fail("num_splits", "an int >= 0 (0: chosen automatically)", num_splits)
    if given_int:
        cache_seqlens = torch.full((batch,), cache_seqlens, dtype=torch.int32, device=q.device)
    if _host_checks_enabled():
        lengths = cache_seqlens.tolist()
        if any(n < 0 or n + new > capacity for n in lengths):
            _fail("cache_seqlens", f"in [0, {capacity - new}] (the cache holds {capacity}, "
                  f"{new} are appended)", lengths)
        if cache_leftpad is not None and any(p < 0 or p > n for p, n in
                                             zip(cache_leftpad.tolist(), lengths)):
            _fail("cache_leftpad", "in [0, cache_seqlens]", cache_leftpad.tolist())
        if cache_batch_idx is not None and any(not 0 <= i < k_cache.shape[0]
                                               for i in cache_batch_idx.tolist()):
            _fail("cache_batch_idx", f"rows in [0, {k_cache.shape[0]})", cache_batch_idx.tolist())
        if paged:
            _check_used_blocks(block_table, [n + new for n in lengths], k_cache.shape[0],
                               k_cache.shape[1])
    _check_devices(q, [("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v),
                       ("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin),
                       ("cache_seqlens", cache_seqlens), ("cache_batch_idx", cache_batch_idx),
                       ("cache_leftpad", cache_leftpad), ("block_table", block_table),
                       ("alibi_slopes", alibi_slopes)])
    return cache_seqlens


def _rotate_queries(q, cos, sin, cache_seqlens, interleaved, per_token):
    """q rotated at positions cache_seqlens[b] + i (per_token), else all at cache_seqlens[b]."""
    from flash_attn.ops.triton.rotary import apply_rotary

    if per_token:
        return apply_rotary(q, cos, sin, seqlen_offsets=cache_seqlens, interleaved=interleaved)
    batch, seqlen_q, num_heads, head_dim = q.shape
    # Every query at one position: fold the queries into the head axis of a single-token tensor.
    folded = q.reshape(batch, 1, seqlen_q * num_heads, head_dim)
    rotated = apply_rotary(folded, cos, sin, seqlen_offsets=cache_seqlens, interleaved=interleaved)
    return rotated.view(batch, seqlen_q, num_heads, head_dim)


def _append_to_cache(k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table):
    """k, v (batch, seqlen_new, h_k, d) into the caches at rows cache_seqlens[b] + i, in place."""
    batch, seqlen_new = k.shape[:2]
    positions = cache_seqlens.long()[:, None] + torch.arange(seqlen_new, device=k.device)
    if block_table is not None:
        page = k_cache.shape[1]
        blocks = torch.gather(block_table.long(), 1, positions // page)
        index = (blocks, positions % page)
    else:
        rows = (torch.arange(batch, device=k.device) if cache_batch_idx is None
                else cache_batch_idx.long())
        index = (rows[:, None].expand(batch, seqlen_new), positions)
    k_cache.index_put_(index, k)
    v_cache.index_put_(index, v)


# The forward's key-block size per kernel head dim, without and with dropout: the mirror of
# ForwardTile in csrc/flash_attn/src/tile_sizes.h (a test checks that they agree).
_FORWARD_KEY_BLOCK = {32: (128, 64), 64: (128, 64), 96: (64, 64), 128: (64, 32), 160: (32, 32),
                      192: (64, 32), 224: (64, 64), 256: (64, 32)}


def _get_block_size_n(device, head_dim, is_dropout, is_causal):
    """Key-block size of the forward kernel that runs this head dim (the S_dmask layout follows
    it): the smallest compiled kernel holding it, as the extension reports when it is built."""
    del device, is_causal  # the same tiles serve every sm80-class GPU and both mask modes
    assert head_dim <= MAX_HEAD_DIM, f"head_dim must be <= {MAX_HEAD_DIM}, got {head_dim}"
    from flash_attn._native import extension_available

    kernel_head_dim = (_cuda_ext().kernel_head_dim(_round_up_8(head_dim))
                       if extension_available("flash_attn_2_cuda") else 0)
    if kernel_head_dim == 0:
        kernel_head_dim = min(d for d in _FORWARD_KEY_BLOCK if d >= head_dim)
    return _FORWARD_KEY_BLOCK[kernel_head_dim][int(bool(is_dropout))]


def _round_up_8(head_dim):
    return round_multiple(head_dim, 8)
