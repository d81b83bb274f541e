"""The torch.library ops of attention: what torch.compile sees. Each calls the extension once.

The autograd Functions and flash_attn_with_kvcache call the ops defined first here, whose
schemas end in AttentionOptions' fields (OP_SCHEMA): the options cross the op boundary flattened
by AttentionOptions.op_args and are rebuilt by AttentionOptions.from_op_args, so adding an
option changes neither. One forward and one backward op serve the padded and the varlen layout
(varlen when cu_seqlens_q is given).

flash-attn 2.8's private ops follow (`_flash_attn_forward` & co.), with its exact schemas, for
code that calls them directly (ring / context-parallel attention libraries do); they run the same
extension calls.
"""

from typing import Optional, Tuple

import torch

from flash_attn._native import load_extension
from flash_attn.attention_options import OP_SCHEMA, AttentionOptions


def _cuda_ext():
    return load_extension("flash_attn_2_cuda")


def maybe_contiguous(x):
    """x with a contiguous last dimension (what the kernels read), or None."""
    return x.contiguous() if x is not None and x.stride(-1) != 1 else x


def round_multiple(x, m):
    return (x + m - 1) // m * m


# ----------------------------------------------------------------------------------------------
# The extension calls: the one place that maps AttentionOptions to the binding's arguments.
# ----------------------------------------------------------------------------------------------


def _extension_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                       block_table, alibi_slopes, options, return_softmax, leftpad_k=None,
                       seqused_k=None, zero_tensors=False):
    """-> out, softmax_lse, S_dmask, rng_state. Varlen when cu_seqlens_q is given."""
    q, k, v = (maybe_contiguous(t) for t in (q, k, v))
    o = options
    if cu_seqlens_q is None:
        results = _cuda_ext().fwd(
            q, k, v, None, alibi_slopes, o.dropout_p, o.softmax_scale, o.causal,
            o.window_size_left, o.window_size_right, o.softcap, return_softmax, None)
    else:
        results = _cuda_ext().varlen_fwd(
            q, k, v, None, cu_seqlens_q, cu_seqlens_k, seqused_k, leftpad_k, block_table,
            alibi_slopes, max_seqlen_q, max_seqlen_k, o.dropout_p, o.softmax_scale, zero_tensors,
            o.causal, o.window_size_left, o.window_size_right, o.softcap, return_softmax, None)
    return tuple(results)


def _extension_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                        max_seqlen_q, max_seqlen_k, alibi_slopes, rng_state, options,
                        zero_tensors=False):
    """Writes dq, dk, dv; -> softmax_d. Varlen when cu_seqlens_q is given."""
    dout, q, k, v, out = (maybe_contiguous(t) for t in (dout, q, k, v, out))
    o = options
    if cu_seqlens_q is None:
        results = _cuda_ext().bwd(
            dout, q, k, v, out, softmax_lse, dq, dk, dv, alibi_slopes, o.dropout_p,
            o.softmax_scale, o.causal, o.window_size_left, o.window_size_right, o.softcap,
            o.deterministic, None, rng_state)
    else:
        results = _cuda_ext().varlen_bwd(
            dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, alibi_slopes,
            max_seqlen_q, max_seqlen_k, o.dropout_p, o.softmax_scale, zero_tensors, o.causal,
            o.window_size_left, o.window_size_right, o.softcap, o.deterministic, None, rng_state)
    return results[3]


def _extension_kvcache(q, k_cache, v_cache, seqlens_k, cache_batch_idx, cache_leftpad,
                       block_table, alibi_slopes, num_splits, options):
    """-> out, softmax_lse of q against the cache (the new keys are already in it)."""
    o = options
    out, softmax_lse = _cuda_ext().fwd_kvcache(
        q, k_cache, v_cache, seqlens_k, cache_batch_idx, cache_leftpad, block_table, alibi_slopes,
        None, o.softmax_scale, o.causal, o.window_size_left, o.window_size_right, o.softcap,
        num_splits)
    return out, softmax_lse


# What the binding allocates, for the fake (meta) implementations.
def _forward_fake(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k, return_softmax):
    out = torch.empty_like(maybe_contiguous(q))
    if cu_seqlens_q is None:
        batch, seqlen_q, num_heads, _ = q.shape
        seqlen_k = k.shape[1]
        softmax_lse = q.new_empty((batch, num_heads, seqlen_q), dtype=torch.float32)
    else:
        total_q, num_heads, _ = q.shape
        batch, seqlen_q, seqlen_k = cu_seqlens_q.numel() - 1, max_seqlen_q, max_seqlen_k
        softmax_lse = q.new_empty((num_heads, total_q), dtype=torch.float32)
    shape_p = ((batch, num_heads, round_multiple(seqlen_q, 128), round_multiple(seqlen_k, 128))
               if return_softmax else (0,))
    return out, softmax_lse, q.new_empty(shape_p), q.new_empty((2,), dtype=torch.int64)


# ----------------------------------------------------------------------------------------------
# The ops of the autograd Functions and of flash_attn_with_kvcache.
# ----------------------------------------------------------------------------------------------

_lib = torch.library.Library("flash_attn", "FRAGMENT")
_lib.define(
    "_attention_forward(Tensor q, Tensor k, Tensor v, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, "
    "SymInt max_seqlen_q, SymInt max_seqlen_k, Tensor? block_table, Tensor? alibi_slopes, "
    f"{OP_SCHEMA}) -> (Tensor, Tensor, Tensor, Tensor)")
_lib.define(
    "_attention_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, "
    "Tensor softmax_lse, Tensor(a!) dq, Tensor(b!) dk, Tensor(c!) dv, Tensor? cu_seqlens_q, "
    "Tensor? cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, Tensor? alibi_slopes, "
    f"Tensor? rng_state, {OP_SCHEMA}) -> Tensor")
_lib.define(
    "_flash_attn_kvcache_forward(Tensor q, Tensor k_cache, Tensor v_cache, Tensor seqlens_k, "
    "Tensor? cache_batch_idx, Tensor? cache_leftpad, Tensor? block_table, Tensor? alibi_slopes, "
    f"SymInt num_splits, {OP_SCHEMA}) -> (Tensor, Tensor)")


@torch.library.impl("flash_attn::_attention_forward", "cuda", lib=_lib)
def _attention_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                       block_table, alibi_slopes, *options):
    options = AttentionOptions.from_op_args(options)
    return _extension_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                              block_table, alibi_slopes, options, options.return_softmax)


@torch.library.register_fake("flash_attn::_attention_forward", lib=_lib)
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, alibi_slopes,
      *options):
    return _forward_fake(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k,
                         AttentionOptions.from_op_args(options).return_softmax)


@torch.library.impl("flash_attn::_attention_backward", "cuda", lib=_lib)
def _attention_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                        max_seqlen_q, max_seqlen_k, alibi_slopes, rng_state, *options):
    return _extension_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q,
                               cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes, rng_state,
                               AttentionOptions.from_op_args(options))


@torch.library.register_fake("flash_attn::_attention_backward", lib=_lib)
def _(dout, q, k, v, out, softmax_lse, *rest):
    return torch.empty_like(softmax_lse)


@torch.library.impl("flash_attn::_flash_attn_kvcache_forward", "cuda", lib=_lib)
def _flash_attn_kvcache_forward(q, k_cache, v_cache, seqlens_k, cache_batch_idx, cache_leftpad,
                                block_table, alibi_slopes, num_splits, *options):
    return _extension_kvcache(q, k_cache, v_cache, seqlens_k, cache_batch_idx, cache_leftpad,
                              block_table, alibi_slopes, num_splits,
                              AttentionOptions.from_op_args(options))


@torch.library.register_fake("flash_attn::_flash_attn_kvcache_forward", lib=_lib)
def _(q, *rest):
    batch, seqlen_q, num_heads, _ = q.shape
    return (torch.empty_like(q),
            q.new_empty((batch, num_heads, seqlen_q), dtype=torch.float32))


# ----------------------------------------------------------------------------------------------
# flash-attn 2.8's private ops: its signatures (names, order, defaults) and results.
# ----------------------------------------------------------------------------------------------


def _options_2_8(dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap,
                 deterministic=False):
    return AttentionOptions(dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                            window_size_left=window_size_left,
                            window_size_right=window_size_right, softcap=softcap,
                            deterministic=deterministic)


@torch.library.custom_op("flash_attn::_flash_attn_forward", mutates_args=(), device_types="cuda")
def _flash_attn_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float, softmax_scale: float,
    causal: bool, window_size_left: int, window_size_right: int, softcap: float,
    alibi_slopes: Optional[torch.Tensor], return_softmax: bool,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    options = _options_2_8(dropout_p, softmax_scale, causal, window_size_left, window_size_right,
                           softcap)
    return _extension_forward(q, k, v, None, None, 0, 0, None, alibi_slopes, options,
                              return_softmax)


@_flash_attn_forward.register_fake
def _(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap,
      alibi_slopes, return_softmax):
    return _forward_fake(q, k, None, 0, 0, return_softmax)


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
    options = _options_2_8(dropout_p, softmax_scale, causal, window_size_left, window_size_right,
                           softcap)
    return _extension_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                              block_table, alibi_slopes, options, return_softmax, leftpad_k,
                              seqused_k, zero_tensors)


@_flash_attn_varlen_forward.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
      causal, window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None,
      return_softmax=False, block_table=None, leftpad_k=None, seqused_k=None, zero_tensors=False):
    return _forward_fake(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k, return_softmax)


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
    options = _options_2_8(dropout_p, softmax_scale, causal, window_size_left, window_size_right,
                           softcap, deterministic)
    return _extension_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, None, None, 0, 0,
                               alibi_slopes, rng_state, options)


@_flash_attn_backward.register_fake
def _(dout, q, k, v, out, softmax_lse, *rest, **kwargs):
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
    options = _options_2_8(dropout_p, softmax_scale, causal, window_size_left, window_size_right,
                           softcap, deterministic)
    return _extension_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q,
                               cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes, rng_state,
                               options, zero_tensors)


@_flash_attn_varlen_backward.register_fake
def _(dout, q, k, v, out, softmax_lse, *rest, **kwargs):
    return torch.empty_like(softmax_lse)


# flash-attn 2.8's autograd Functions call the ops through these (the torch.ops handles on
# PyTorch >= 2.4, which this package requires).
_wrapped_flash_attn_forward = torch.ops.flash_attn._flash_attn_forward
_wrapped_flash_attn_varlen_forward = torch.ops.flash_attn._flash_attn_varlen_forward
_wrapped_flash_attn_backward = torch.ops.flash_attn._flash_attn_backward
_wrapped_flash_attn_varlen_backward = torch.ops.flash_attn._flash_attn_varlen_backward
