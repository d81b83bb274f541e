"""The attention entry points: flash-attn 2.x's public functions and their autograd Functions.

Data flows one way: a public function checks its arguments (flash_attn/attention_checks.py) and
gathers its scalar options into one AttentionOptions (flash_attn/attention_options.py), an
autograd Function pads the head dim and calls a `torch.ops.flash_attn.*` op
(flash_attn/attention_ops.py), and the op calls the `flash_attn_2_cuda` extension.
The module-level names of flash-attn 2.8's interface (the private ops `_flash_attn_forward` & co.
with their signatures, `_wrapped_*`, `maybe_contiguous`, `round_multiple`, `_get_block_size_n`,
`USE_TRITON_ROCM`, `flash_attn_gpu`) are here with the same meaning, for code that imports them.
The autograd Functions keep flash-attn's names, but their forward takes the scalar options as one
AttentionOptions where flash-attn's takes them one by one.
"""

import dataclasses

import torch
import torch.nn.functional as F

from flash_attn.attention_checks import (
    MAX_HEAD_DIM,
    _check_attention_args,
    _check_kvcache_args,
    _fail,
)
from flash_attn.attention_options import AttentionOptions
from flash_attn.attention_ops import (  # noqa: F401  (flash-attn 2.8's module-level names)
    _cuda_ext,
    _flash_attn_backward,
    _flash_attn_forward,
    _flash_attn_varlen_backward,
    _flash_attn_varlen_forward,
    _wrapped_flash_attn_backward,
    _wrapped_flash_attn_forward,
    _wrapped_flash_attn_varlen_backward,
    _wrapped_flash_attn_varlen_forward,
    maybe_contiguous,
    round_multiple,
)

# flash-attn 2.8 can run on ROCm through a Triton backend chosen by this flag; this package has
# only the CUDA kernels, so it is always False here.
USE_TRITON_ROCM = False

# flash-attn 2.8's names for the torch.library decorators its ops are registered with.
_torch_custom_op_wrapper = torch.library.custom_op
_torch_register_fake_wrapper = torch.library.register_fake


def __getattr__(name):
    # flash-attn binds the extension at import as `flash_attn_gpu`; here it loads on first use, so
    # that importing this module never fails on a machine where it is not built.
    if name == "flash_attn_gpu":
        return _cuda_ext()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ----------------------------------------------------------------------------------------------
# The autograd Functions: one base does the work, each subclass says how its inputs are packed.
# ----------------------------------------------------------------------------------------------

# What padded (not varlen) inputs pass for (cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
# max_seqlen_k, block_table).
_PADDED = (None, None, 0, 0, None)


def _pad_head_dim(*tensors):
    """The kernels take head dims that are multiples of 8; pad (and later slice) the rest."""
    head_dim = tensors[0].shape[-1]
    if head_dim % 8 == 0:
        return tensors
    pad = 8 - head_dim % 8
    return tuple(None if t is None else F.pad(t, [0, pad]) for t in tensors)


class _FlashAttnBase(torch.autograd.Function):
    """Forward and backward of every non-kvcache entry point. A subclass's forward takes its
    inputs (tensors, and for varlen the offsets and max lengths), then alibi_slopes, an
    AttentionOptions and is_grad_enabled; its backward returns through _unpacked or _packed, which
    give the gradients of q, k, v (or the packed input) and a None for each other input."""

    @staticmethod
    def _run(ctx, q, k, v, varlen, alibi_slopes, options, is_grad_enabled, grads_needed):
        head_dim = q.shape[-1]
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table = varlen
        q_p, k_p, v_p = _pad_head_dim(q, k, v)
        out, softmax_lse, S_dmask, rng_state = torch.ops.flash_attn._attention_forward(
            q_p, k_p, v_p, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table,
            alibi_slopes, *options.op_args(head_dim))
        if is_grad_enabled and grads_needed:
            ctx.save_for_backward(q_p, k_p, v_p, out, softmax_lse, rng_state, cu_seqlens_q,
                                  cu_seqlens_k)
            ctx.options, ctx.alibi_slopes, ctx.head_dim = options, alibi_slopes, head_dim
            ctx.max_seqlens = (max_seqlen_q, max_seqlen_k)
            ctx.paged = block_table is not None
        out = out[..., :head_dim]
        return (out, softmax_lse, S_dmask) if options.return_attn_probs else out

    @staticmethod
    def _grads(ctx, dout, dq=None, dk=None, dv=None):
        """dq, dk, dv of the saved forward, in the padded head dim of its inputs. dq/dk/dv may be
        views into a packed gradient (written in place, no copy)."""
        if ctx.paged:
            raise NotImplementedError("flash_attn: no backward through a paged K/V cache (block_table)")
        q, k, v, out, softmax_lse, rng_state, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
        (dout,) = _pad_head_dim(dout)
        if dout.stride(-1) != 1:
            dout = dout.contiguous()
        dq = torch.empty_like(q) if dq is None else dq
        dk = torch.empty_like(k) if dk is None else dk
        dv = torch.empty_like(v) if dv is None else dv
        torch.ops.flash_attn._attention_backward(
            dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
            *ctx.max_seqlens, ctx.alibi_slopes, rng_state, *ctx.options.op_args(ctx.head_dim))
        return dq, dk, dv

    @staticmethod
    def _with_none_for_the_rest(ctx, grads):
        # backward returns one gradient per forward input: None for the non-tensor ones.
        return tuple(grads) + (None,) * (len(ctx.needs_input_grad) - len(grads))

    @staticmethod
    def _unpacked(ctx, dout):
        head_dim = ctx.head_dim
        grads = tuple(g[..., :head_dim] for g in _FlashAttnBase._grads(ctx, dout))
        return _FlashAttnBase._with_none_for_the_rest(ctx, grads)

    @staticmethod
    def _packed(ctx, dout, dim, first):
        """The gradients of the unpacked inputs (the first `first` of q, k, v) and of the packed
        one (the rest, stacked along dim). Without head-dim padding the kernel writes straight into
        views of the packed buffer, so no copy is made."""
        if ctx.head_dim % 8 != 0:
            grads = tuple(g[..., :ctx.head_dim] for g in _FlashAttnBase._grads(ctx, dout))
            grads = grads[:first] + (torch.stack(grads[first:], dim=dim),)
        else:
            member = ctx.saved_tensors[first]  # every member of the packed input has its shape
            shape = list(member.shape)
            shape.insert(dim, 3 - first)
            packed = member.new_empty(shape)
            grads = _FlashAttnBase._grads(ctx, dout, *([None] * first), *packed.unbind(dim))
            grads = grads[:first] + (packed,)
        return _FlashAttnBase._with_none_for_the_rest(ctx, grads)


class FlashAttnFunc(_FlashAttnBase):
    @staticmethod
    def forward(ctx, q, k, v, alibi_slopes, options, is_grad_enabled):
        needs = any(t.requires_grad for t in (q, k, v))
        return _FlashAttnBase._run(ctx, q, k, v, _PADDED, alibi_slopes, options, is_grad_enabled,
                                   needs)

    @staticmethod
    def backward(ctx, dout, *_):
        return _FlashAttnBase._unpacked(ctx, dout)


class FlashAttnQKVPackedFunc(_FlashAttnBase):
    @staticmethod
    def forward(ctx, qkv, alibi_slopes, options, is_grad_enabled):
        q, k, v = qkv.unbind(dim=2)
        return _FlashAttnBase._run(ctx, q, k, v, _PADDED, alibi_slopes, options, is_grad_enabled,
                                   qkv.requires_grad)

    @staticmethod
    def backward(ctx, dout, *_):
        return _FlashAttnBase._packed(ctx, dout, dim=2, first=0)


class FlashAttnKVPackedFunc(_FlashAttnBase):
    @staticmethod
    def forward(ctx, q, kv, alibi_slopes, options, is_grad_enabled):
        k, v = kv.unbind(dim=2)
        needs = q.requires_grad or kv.requires_grad
        return _FlashAttnBase._run(ctx, q, k, v, _PADDED, alibi_slopes, options, is_grad_enabled,
                                   needs)

    @staticmethod
    def backward(ctx, dout, *_):
        return _FlashAttnBase._packed(ctx, dout, dim=2, first=1)


class FlashAttnVarlenFunc(_FlashAttnBase):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table,
                alibi_slopes, options, is_grad_enabled):
        needs = any(t.requires_grad for t in (q, k, v))
        varlen = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table)
        return _FlashAttnBase._run(ctx, q, k, v, varlen, alibi_slopes, options, is_grad_enabled,
                                   needs)

    @staticmethod
    def backward(ctx, dout, *_):
        return _FlashAttnBase._unpacked(ctx, dout)


class FlashAttnVarlenQKVPackedFunc(_FlashAttnBase):
    @staticmethod
    def forward(ctx, qkv, cu_seqlens, max_seqlen, alibi_slopes, options, is_grad_enabled):
        q, k, v = qkv.unbind(dim=1)
        varlen = (cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, None)
        return _FlashAttnBase._run(ctx, q, k, v, varlen, alibi_slopes, options, is_grad_enabled,
                                   qkv.requires_grad)

    @staticmethod
    def backward(ctx, dout, *_):
        return _FlashAttnBase._packed(ctx, dout, dim=1, first=0)


class FlashAttnVarlenKVPackedFunc(_FlashAttnBase):
    @staticmethod
    def forward(ctx, q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes,
                options, is_grad_enabled):
        k, v = kv.unbind(dim=1)
        needs = q.requires_grad or kv.requires_grad
        varlen = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, None)
        return _FlashAttnBase._run(ctx, q, k, v, varlen, alibi_slopes, options, is_grad_enabled,
                                   needs)

    @staticmethod
    def backward(ctx, dout, *_):
        return _FlashAttnBase._packed(ctx, dout, dim=1, first=1)


# ----------------------------------------------------------------------------------------------
# Public functions (flash-attn 2.x signatures).
# ----------------------------------------------------------------------------------------------


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False):
    """qkv: (batch, seqlen, 3, nheads, headdim). Returns out (batch, seqlen, nheads, headdim),
    plus (softmax_lse, S_dmask) when return_attn_probs."""
    options = AttentionOptions.create(
        dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
        softcap=softcap, deterministic=deterministic, return_attn_probs=return_attn_probs)
    if not isinstance(qkv, torch.Tensor) or qkv.dim() != 5 or qkv.shape[2] != 3:
        _fail("qkv", "a (batch, seqlen, 3, nheads, headdim) tensor", getattr(qkv, "shape", qkv))
    _check_attention_args(*qkv.unbind(dim=2), varlen=False, alibi_slopes=alibi_slopes)
    return FlashAttnQKVPackedFunc.apply(qkv, alibi_slopes, options, torch.is_grad_enabled())


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_attn_probs=False):
    """q: (batch, seqlen_q, nheads, headdim), kv: (batch, seqlen_k, 2, nheads_k, headdim)."""
    options = AttentionOptions.create(
        dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
        softcap=softcap, deterministic=deterministic, return_attn_probs=return_attn_probs)
    if not isinstance(kv, torch.Tensor) or kv.dim() != 5 or kv.shape[2] != 2:
        _fail("kv", "a (batch, seqlen_k, 2, nheads_k, headdim) tensor", getattr(kv, "shape", kv))
    _check_attention_args(q, *kv.unbind(dim=2), varlen=False, alibi_slopes=alibi_slopes)
    return FlashAttnKVPackedFunc.apply(q, kv, alibi_slopes, options, torch.is_grad_enabled())


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
    options = AttentionOptions.create(
        dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
        softcap=softcap, deterministic=deterministic, return_attn_probs=return_attn_probs)
    _check_attention_args(q, k, v, varlen=False, alibi_slopes=alibi_slopes)
    return FlashAttnFunc.apply(q, k, v, alibi_slopes, options, torch.is_grad_enabled())


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0,
                                     softmax_scale=None, causal=False, window_size=(-1, -1),
                                     softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """qkv: (total, 3, nheads, headdim); cu_seqlens: (batch + 1,) int32."""
    options = AttentionOptions.create(
        dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
        softcap=softcap, deterministic=deterministic, return_attn_probs=return_attn_probs)
    if not isinstance(qkv, torch.Tensor) or qkv.dim() != 4 or qkv.shape[1] != 3:
        _fail("qkv", "a (total, 3, nheads, headdim) tensor", getattr(qkv, "shape", qkv))
    _check_attention_args(*qkv.unbind(dim=1), varlen=True, cu_seqlens_q=cu_seqlens,
                          cu_seqlens_k=cu_seqlens, max_seqlen_q=max_seqlen,
                          max_seqlen_k=max_seqlen, alibi_slopes=alibi_slopes)
    return FlashAttnVarlenQKVPackedFunc.apply(qkv, cu_seqlens, max_seqlen, alibi_slopes, options,
                                              torch.is_grad_enabled())


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, dropout_p=0.0, softmax_scale=None,
                                    causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False,
                                    return_attn_probs=False):
    """q: (total_q, nheads, headdim); kv: (total_k, 2, nheads_k, headdim)."""
    options = AttentionOptions.create(
        dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
        softcap=softcap, deterministic=deterministic, return_attn_probs=return_attn_probs)
    if not isinstance(kv, torch.Tensor) or kv.dim() != 4 or kv.shape[1] != 2:
        _fail("kv", "a (total_k, 2, nheads_k, headdim) tensor", getattr(kv, "shape", kv))
    _check_attention_args(q, *kv.unbind(dim=1), varlen=True, cu_seqlens_q=cu_seqlens_q,
                          cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                          max_seqlen_k=max_seqlen_k, alibi_slopes=alibi_slopes)
    return FlashAttnVarlenKVPackedFunc.apply(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                             max_seqlen_k, alibi_slopes, options,
                                             torch.is_grad_enabled())


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None, deterministic=False,
                           return_attn_probs=False, block_table=None):
    """Attention over a batch of sequences of different lengths, concatenated along dim 0.

    q: (total_q, nheads, headdim); k, v: (total_k, nheads_k, headdim), or with block_table
    (batch, max_blocks) int32 a paged cache (num_blocks, page_block_size, nheads_k, headdim).
    cu_seqlens_q/k: (batch + 1,) int32 offsets. softmax_lse is (nheads, total_q).
    """
    options = AttentionOptions.create(
        dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
        softcap=softcap, deterministic=deterministic, return_attn_probs=return_attn_probs)
    _check_attention_args(q, k, v, varlen=True, cu_seqlens_q=cu_seqlens_q,
                          cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                          max_seqlen_k=max_seqlen_k, alibi_slopes=alibi_slopes,
                          block_table=block_table)
    return FlashAttnVarlenFunc.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                     max_seqlen_k, block_table, alibi_slopes, options,
                                     torch.is_grad_enabled())


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
    options = AttentionOptions.create(softmax_scale=softmax_scale, causal=causal,
                                      window_size=window_size, softcap=softcap)
    cache_seqlens = _check_kvcache_args(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin,
                                        cache_seqlens, cache_batch_idx, cache_leftpad,
                                        block_table, alibi_slopes, num_splits)
    if q.shape[1] == 1 and alibi_slopes is None and options.window_size_left < 0:
        # One query is aligned with its entry's last key: a causal mask or a right window hides
        # nothing (flash-attn drops causal here too), and the GQA row packing below then applies.
        options = dataclasses.replace(options, causal=False, window_size_right=-1)
    # A causal or sliding-window mask was asked for (flash-attn's "local"); whether it bounds
    # any key is the binding's business.
    local = options.causal or options.window_size_left >= 0 or options.window_size_right >= 0
    if rotary_cos is not None:
        q = _rotate_queries(q, rotary_cos, rotary_sin, cache_seqlens, rotary_interleaved,
                            per_token=local)
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
    # are the same for every row: no causal or window mask, no ALiBi.
    swap = seqlen_q == 1 and num_heads > num_heads_k and not local and alibi_slopes is None
    if swap:
        group = num_heads // num_heads_k
        q = q.reshape(batch, num_heads_k, group, head_dim).transpose(1, 2)
    out, softmax_lse = torch.ops.flash_attn._flash_attn_kvcache_forward(
        q, k_cache, v_cache, seqlens_k, cache_batch_idx, cache_leftpad, block_table, alibi_slopes,
        num_splits, *options.op_args(head_dim))
    if swap:
        out = out.transpose(1, 2).reshape(batch, 1, num_heads, head_dim)
        softmax_lse = softmax_lse.reshape(batch, num_heads, 1)  # (b, h_k, group): head-major
    return (out, softmax_lse) if return_softmax_lse else out


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

    kernel_head_dim = (_cuda_ext().kernel_head_dim(round_multiple(head_dim, 8))
                       if extension_available("flash_attn_2_cuda") else 0)
    if kernel_head_dim == 0:
        kernel_head_dim = min(d for d in _FORWARD_KEY_BLOCK if d >= head_dim)
    return _FORWARD_KEY_BLOCK[kernel_head_dim][int(bool(is_dropout))]
