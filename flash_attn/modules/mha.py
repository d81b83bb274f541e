"""Multi-head attention: MHA and ParallelMHA, which add the in / out projections, rotary
embeddings and the kv cache for inference around an inner attention module.

Paths: `use_flash_attn=True` runs the flash-attn kernels (CUDA, fp16/bf16; FlashSelfAttention,
FlashCrossAttention); otherwise SelfAttention / CrossAttention compute the same thing in PyTorch
(any device and dtype), which is what the CPU tests run. The inner modules live in
flash_attn.modules.inner_attention and are importable from here, as in flash-attn.
"""

import importlib
import math
import warnings
from functools import partial

import torch
import torch.nn as nn
from einops import rearrange

from flash_attn import flash_attn_interface as fai
from flash_attn.modules.inner_attention import (  # noqa: F401  (flash-attn's import path)
    CrossAttention,
    FlashCrossAttention,
    FlashSelfAttention,
    SelfAttention,
    fp32_slopes,
)
from flash_attn.ops.fused_dense import ColumnParallelLinear, FusedDense, RowParallelLinear
from flash_attn.utils.autocast import compute_dtype
from flash_attn.utils.distributed import get_dim_for_local_rank
from flash_attn.utils.testing import attention_ref

# ----------------------------------------------------------------------------------------------
# Helpers other modules share: optional imports and the fallback warning.
# ----------------------------------------------------------------------------------------------

_warned = set()


def import_optional(module, name):
    """`module.name`, or None when `module` or a third-party package it needs (triton, say) is
    not installed. Anything else propagates: an error inside the module, a missing name, or a
    missing flash_attn module that it imports is a bug, not an absent option. (No module of
    this package needs its CUDA extensions to import: they load at first call.)"""
    try:
        found = importlib.import_module(module)
    except ModuleNotFoundError as error:
        missing = error.name or ""
        inside_package = missing.split(".")[0] == "flash_attn"
        if inside_package and not (module == missing or module.startswith(missing + ".")):
            raise
        return None
    return getattr(found, name)


def warn_fallback(flag, reason):
    """One warning per flag: the fused path was asked for, the plain PyTorch path runs instead."""
    if flag not in _warned:
        _warned.add(flag)
        warnings.warn(f"flash_attn: {flag} requested but {reason}; using the PyTorch path.")


def get_alibi_slopes(nheads):
    """ALiBi head slopes: a geometric sequence 2^(-8/n), 2^(-16/n), ... for n a power of two;
    otherwise the slopes of the nearest lower power of two, topped up with every other slope of
    the next power of two (the ALiBi paper's recipe)."""

    def power_of_two_slopes(n):
        first = 2.0 ** (-8.0 / n)
        return [first ** (i + 1) for i in range(n)]

    if math.log2(nheads).is_integer():
        return power_of_two_slopes(nheads)
    lower = 2 ** math.floor(math.log2(nheads))
    return power_of_two_slopes(lower) + get_alibi_slopes(2 * lower)[0::2][: nheads - lower]


# The rotary module MHA builds (reported by extra_repr and models' path summaries).
ROTARY_PATH = "flash_attn.layers.rotary (Triton on GPU, PyTorch on CPU)"


# ----------------------------------------------------------------------------------------------
# MHA.
# ----------------------------------------------------------------------------------------------


class LinearResidual(nn.Linear):
    """nn.Linear that also returns its input, so a block can fuse the residual add."""

    def forward(self, input):
        return super().forward(input), input


def _new_kv_cache(batch_size, max_seqlen, num_heads_kv, head_dim, dtype, device):
    # zeros, not empty: the PyTorch path multiplies masked (probability 0) slots by them.
    return torch.zeros(batch_size, max_seqlen, 2, num_heads_kv, head_dim, dtype=dtype,
                       device=device)


def _layer_kv_cache(inference_params, layer_idx, kv):
    """This layer's cache, allocated on first use in the dtype of the keys it will hold."""
    caches = inference_params.key_value_memory_dict
    if layer_idx not in caches:
        caches[layer_idx] = _new_kv_cache(inference_params.max_batch_size,
                                          inference_params.max_seqlen, kv.shape[-2],
                                          kv.shape[-1], kv.dtype, kv.device)
    return caches[layer_idx]


def _update_kv_cache(kv, inference_params, layer_idx):
    """flash-attn's helper: writes kv (b, s, 2, h_k, d) into the layer's cache at
    inference_params' batch and sequence offsets (allocating it in kv's dtype on first use) and
    returns the cache up to the last written position, (b, offset + s, 2, h_k, d)."""
    cache = _layer_kv_cache(inference_params, layer_idx, kv)
    batch_start = inference_params.batch_size_offset
    batch_end = batch_start + kv.shape[0]
    seq_start = inference_params.seqlen_offset
    seq_end = seq_start + kv.shape[1]
    if batch_end > cache.shape[0] or seq_end > cache.shape[1]:
        raise ValueError(f"flash_attn: kv of batch rows [{batch_start}, {batch_end}) and positions "
                         f"[{seq_start}, {seq_end}) does not fit the cache of shape "
                         f"{tuple(cache.shape)}")
    cache[batch_start:batch_end, seq_start:seq_end] = kv
    return cache[batch_start:batch_end, :seq_end]


def dense_classes(fused_bias_fc):
    """(linear, linear returning its input) for the fused or plain path."""
    if fused_bias_fc:
        return FusedDense, partial(FusedDense, return_residual=True)
    return nn.Linear, LinearResidual


class MHA(nn.Module):
    """Multi-head (or grouped-query) self / cross attention with in and out projections.

    x (b, s, embed_dim), or (total, embed_dim) with cu_seqlens/max_seqlen (varlen). Options pick
    modules: use_flash_attn the inner attention, fused_bias_fc the projections, rotary_emb_dim
    the rotary module; inference_params (utils.generation.InferenceParams) turns on the kv cache.
    """

    def __init__(self, embed_dim, num_heads, num_heads_kv=None, cross_attn=False,
                 qkv_proj_bias=True, out_proj_bias=True, dropout=0.0, softmax_scale=None,
                 causal=False, layer_idx=None, dwconv=False, rotary_emb_dim=0,
                 rotary_emb_base=10000.0, rotary_emb_scale_base=None,
                 rotary_emb_interleaved=False, use_alibi=False, window_size=(-1, -1),
                 fused_bias_fc=False, use_flash_attn=False, return_residual=False,
                 checkpointing=False, device=None, dtype=None):
        factory = {"device": device, "dtype": dtype}
        super().__init__()
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.num_heads_kv = num_heads_kv if num_heads_kv is not None else num_heads
        if num_heads % self.num_heads_kv != 0:
            raise ValueError(f"num_heads ({num_heads}) must be divisible by num_heads_kv "
                             f"({self.num_heads_kv})")
        if embed_dim % num_heads != 0:
            raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        self.head_dim = embed_dim // num_heads
        self.cross_attn, self.causal, self.layer_idx = cross_attn, causal, layer_idx
        self.dwconv, self.rotary_emb_dim = dwconv, rotary_emb_dim
        self.use_flash_attn, self.return_residual = use_flash_attn, return_residual
        self.checkpointing, self.softmax_scale, self.window_size = checkpointing, softmax_scale, window_size
        qkv_dim = self.head_dim * (num_heads + 2 * self.num_heads_kv)
        kv_dim = 2 * self.head_dim * self.num_heads_kv

        alibi_slopes = (torch.tensor(get_alibi_slopes(num_heads), device=device)
                        if use_alibi else None)
        if rotary_emb_dim > 0:
            if cross_attn:
                raise ValueError("MHA: rotary embeddings are not supported with cross_attn")
            self._init_rotary(rotary_emb_dim, rotary_emb_base, rotary_emb_scale_base,
                              rotary_emb_interleaved, device)

        linear_cls, linear_resid_cls = dense_classes(fused_bias_fc)
        in_proj_cls = linear_resid_cls if return_residual else linear_cls
        if not cross_attn:
            self.Wqkv = in_proj_cls(embed_dim, qkv_dim, bias=qkv_proj_bias, **factory)
        else:
            self.Wq = in_proj_cls(embed_dim, embed_dim, bias=qkv_proj_bias, **factory)
            self.Wkv = linear_cls(embed_dim, kv_dim, bias=qkv_proj_bias, **factory)
        if dwconv:  # causal depthwise conv over the sequence (Primer-style)
            if cross_attn:
                self.dwconv_q = nn.Conv1d(embed_dim, embed_dim, 3, padding=2, groups=embed_dim, **factory)
                self.dwconv_kv = nn.Conv1d(kv_dim, kv_dim, 3, padding=2, groups=kv_dim, **factory)
            else:
                self.dwconv_qkv = nn.Conv1d(qkv_dim, qkv_dim, 3, padding=2, groups=qkv_dim, **factory)

        self._init_inner_attention(use_flash_attn, causal, softmax_scale, dropout, window_size,
                                   alibi_slopes)
        self.out_proj = linear_cls(embed_dim, embed_dim, bias=out_proj_bias, **factory)

    def _init_rotary(self, dim, base, scale_base, interleaved, device):
        # Imported here, not at the top: it brings in triton, which only rotary models need.
        from flash_attn.layers.rotary import RotaryEmbedding

        self.rotary_path = ROTARY_PATH
        self.rotary_emb = RotaryEmbedding(dim, base=base, scale_base=scale_base,
                                          interleaved=interleaved, device=device)

    def _init_inner_attention(self, use_flash_attn, causal, softmax_scale, dropout, window_size,
                              alibi_slopes):
        kwargs = dict(causal=causal, softmax_scale=softmax_scale, attention_dropout=dropout,
                      window_size=window_size, alibi_slopes=alibi_slopes)
        self.inner_attn = (FlashSelfAttention if use_flash_attn else SelfAttention)(**kwargs)
        self.inner_cross_attn = (FlashCrossAttention if use_flash_attn else CrossAttention)(**kwargs)

    def extra_repr(self):
        rotary = f", rotary={self.rotary_path}" if self.rotary_emb_dim > 0 else ""
        return f"attention={'flash' if self.use_flash_attn else 'torch'}{rotary}"

    # -- kv cache ------------------------------------------------------------------------------

    def allocate_inference_cache(self, batch_size, max_seqlen, dtype=None):
        """(batch, max_seqlen, 2, h_k, d) zeros in `dtype`, by default the dtype attention sees:
        autocast's when it is on (fp32 weights under bf16 autocast give bf16 keys), else the
        weights'."""
        weight = self.out_proj.weight
        if dtype is None:
            dtype = compute_dtype(weight.device.type, weight.dtype)
        return _new_kv_cache(batch_size, max_seqlen, self.num_heads_kv, self.head_dim, dtype,
                             weight.device)

    def _attend_with_cache(self, q, kv, inference_params):
        """Append kv (b, s, 2, h_k, d) to this layer's cache; attend q to the whole cache."""
        start = inference_params.batch_size_offset
        cache = _layer_kv_cache(inference_params, self.layer_idx, kv)[start: start + q.shape[0]]
        if cache.dtype != kv.dtype:
            # A cache allocated outside autocast (or in another dtype): attention runs in the
            # cache's dtype, q included, rather than mixing dtypes.
            q, kv = q.to(cache.dtype), kv.to(cache.dtype)
        lengths = inference_params.lengths_per_sample
        cache_seqlens = (lengths[start: start + q.shape[0]] if lengths is not None
                         else inference_params.seqlen_offset)
        use_flash = self.use_flash_attn and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
        if use_flash and self.head_dim % 8 == 0:
            seqlens = cache_seqlens
            if not isinstance(seqlens, torch.Tensor):
                seqlens = torch.full((q.shape[0],), seqlens, dtype=torch.int32, device=q.device)
            # The caches are views into one (b, s, 2, h_k, d) buffer; the kernel appends kv in place.
            return fai.flash_attn_with_kvcache(
                q, cache[:, :, 0], cache[:, :, 1], kv[:, :, 0], kv[:, :, 1],
                cache_seqlens=seqlens.to(torch.int32),
                softmax_scale=self.inner_cross_attn.softmax_scale, causal=self.causal,
                window_size=self.window_size,
                alibi_slopes=fp32_slopes(self.inner_cross_attn.alibi_slopes))
        seqlen = q.shape[1]
        if isinstance(cache_seqlens, int):
            cache[:, cache_seqlens: cache_seqlens + seqlen] = kv
            keys = cache[:, : cache_seqlens + seqlen]
            if use_flash:
                return self.inner_cross_attn(q, keys)
            key_padding_mask = None
        else:  # per-sample lengths (CUDA-graph decoding): fixed shapes, masks instead of slices
            pos = cache_seqlens.view(-1, 1).long() + torch.arange(seqlen, device=q.device)
            rows = torch.arange(q.shape[0], device=q.device).view(-1, 1)
            cache[rows, pos] = kv.to(cache.dtype)
            keys = cache
            key_padding_mask = (torch.arange(cache.shape[1], device=q.device)
                                < (cache_seqlens.view(-1, 1) + seqlen))
        attn = self.inner_cross_attn
        out, _ = attention_ref(q, keys[:, :, 0], keys[:, :, 1], key_padding_mask=key_padding_mask,
                               causal=self.causal, softmax_scale=attn.softmax_scale,
                               window_size=self.window_size, alibi_slopes=attn.alibi_slopes)
        return out

    # -- forward -------------------------------------------------------------------------------

    def _project(self, x, x_kv, mixer_subset):
        """-> (qkv, None) packed (..., 3, h, d) when heads match and not cross_attn, else
        (q (..., h, d), kv (..., 2, h_k, d)); and the input when return_residual."""
        residual = None
        if not self.cross_attn:
            if x_kv is not None or mixer_subset is not None:
                raise ValueError("MHA: x_kv and mixer_subset need cross_attn=True")
            qkv = self.Wqkv(x)
            if self.return_residual:
                qkv, residual = qkv
            if self.dwconv:
                qkv = _causal_dwconv(self.dwconv_qkv, qkv)
            return (*self._unpack_qkv(qkv), residual)
        q = self.Wq(x if mixer_subset is None else x[:, mixer_subset])
        if self.return_residual:
            q, residual = q
        kv = self.Wkv(x_kv if x_kv is not None else x)
        if self.dwconv:
            q, kv = _causal_dwconv(self.dwconv_q, q), _causal_dwconv(self.dwconv_kv, kv)
        return (*self._heads(q, kv), residual)

    def _heads(self, q, kv):
        """(..., h * d), (..., 2 * h_k * d) -> q (..., h, d), kv (..., 2, h_k, d)."""
        return (q.unflatten(-1, (self.num_heads, self.head_dim)),
                kv.unflatten(-1, (2, self.num_heads_kv, self.head_dim)))

    def _unpack_qkv(self, qkv):
        """The packed in-projection (..., (h + 2 h_k) d) -> (qkv (..., 3, h, d), None) when the
        heads match, else (q, kv) as _heads gives them."""
        if self.num_heads_kv == self.num_heads:
            return qkv.unflatten(-1, (3, self.num_heads, self.head_dim)), None
        return self._heads(*_split_q_kv(qkv, self.num_heads * self.head_dim))

    def _apply_rotary(self, q_or_qkv, kv, inference_params):
        if inference_params is None:
            offset, max_seqlen = 0, None
        else:
            offset = (inference_params.lengths_per_sample
                      if inference_params.lengths_per_sample is not None
                      else inference_params.seqlen_offset)
            max_seqlen = inference_params.max_seqlen
        if kv is None:
            return self.rotary_emb(q_or_qkv, seqlen_offset=offset, max_seqlen=max_seqlen), None
        return self.rotary_emb(q_or_qkv, kv, seqlen_offset=offset, max_seqlen=max_seqlen)

    def _attend(self, q_or_qkv, kv, key_padding_mask=None, cu_seqlens=None, max_seqlen=None,
                cu_seqlens_k=None, max_seqlen_k=None):
        if self.use_flash_attn:
            if key_padding_mask is not None:
                raise ValueError("MHA: key_padding_mask needs use_flash_attn=False; with flash "
                                 "attention unpad the batch (bert_padding) and pass cu_seqlens")
            varlen = {}
        else:
            varlen = {"key_padding_mask": key_padding_mask}
        if cu_seqlens is not None:
            varlen.update(cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
        if kv is None:
            fn, args = self.inner_attn, (q_or_qkv,)
        else:
            fn, args = self.inner_cross_attn, (q_or_qkv, kv)
            if cu_seqlens is not None:  # keys packed like the queries unless told otherwise
                varlen.update(cu_seqlens_k=cu_seqlens if cu_seqlens_k is None else cu_seqlens_k,
                              max_seqlen_k=max_seqlen if max_seqlen_k is None else max_seqlen_k)
            if key_padding_mask is not None and not self.cross_attn:
                varlen["query_padding_mask"] = key_padding_mask  # self-attention: shared padding
        if self.checkpointing and self.training:
            return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, **varlen)
        return fn(*args, **varlen)

    def _context(self, q_or_qkv, kv, inference_params, *attend_args):
        """Rotary embeddings, then attention: over the kv cache with inference_params, else
        _attend(q_or_qkv, kv, *attend_args)."""
        if self.rotary_emb_dim > 0:
            q_or_qkv, kv = self._apply_rotary(q_or_qkv, kv, inference_params)
        if inference_params is None:
            return self._attend(q_or_qkv, kv, *attend_args)
        return self._attend_in_inference(q_or_qkv, kv, inference_params)

    def _attend_in_inference(self, q_or_qkv, kv, inference_params):
        if kv is None:
            q_or_qkv, kv = q_or_qkv[..., 0, :, :], q_or_qkv[..., 1:, :, :]
        if inference_params.seqlen_offset == 0:
            # Prefill: attention over the prompt alone, and the cache filled for later steps.
            _update_kv_cache(kv, inference_params, self.layer_idx)
            return self._attend(q_or_qkv, kv)
        return self._attend_with_cache(q_or_qkv, kv, inference_params)

    def forward(self, x, x_kv=None, key_padding_mask=None, cu_seqlens=None, max_seqlen=None,
                mixer_subset=None, inference_params=None, **kwargs):
        """x (b, s, d) or packed (total, d) with cu_seqlens; cross_attn: keys from x_kv (default
        x), queries from x[:, mixer_subset]; packed x_kv takes cu_seqlens_k / max_seqlen_k in
        kwargs. Returns (b, s, d) (and the input with return_residual)."""
        if inference_params is not None and (cu_seqlens is not None or key_padding_mask is not None
                                             or self.dwconv):
            raise ValueError("MHA: inference_params cannot be combined with cu_seqlens, "
                             "key_padding_mask or dwconv")
        q_or_qkv, kv, residual = self._project(x, x_kv, mixer_subset)
        context = self._context(q_or_qkv, kv, inference_params, key_padding_mask, cu_seqlens,
                                max_seqlen, kwargs.get("cu_seqlens_k"), kwargs.get("max_seqlen_k"))
        out = self.out_proj(context.flatten(-2))
        return out if not self.return_residual else (out, residual)


def _split_q_kv(qkv, q_dim):
    """Two slices, not split(): the rotary kernel rotates q and k in place, which autograd
    refuses on the outputs of a multi-view op like split."""
    return qkv[..., :q_dim], qkv[..., q_dim:]


def _causal_dwconv(conv, x):
    """Depthwise conv over the sequence of x (b, s, d), seeing only the current and past rows."""
    return rearrange(conv(rearrange(x, "b s d -> b d s"))[..., :-2], "b d s -> b s d").contiguous()


# ----------------------------------------------------------------------------------------------
# Tensor-parallel MHA: heads split over process_group ranks.
# ----------------------------------------------------------------------------------------------


class ParallelMHA(MHA):
    """MHA with Wqkv column-parallel and out_proj row-parallel over process_group.

    Each rank holds its share of heads (get_dim_for_local_rank). With sequence_parallel the input
    is this rank's slice of the (batch * seqlen) rows; pass seqlen to say how to unflatten it.
    """

    def __init__(self, embed_dim, num_heads, process_group, num_heads_kv=None,
                 qkv_proj_bias=True, out_proj_bias=True, dropout=0.0, softmax_scale=None,
                 causal=False, layer_idx=None, rotary_emb_dim=0, rotary_emb_base=10000.0,
                 rotary_emb_scale_base=None, rotary_emb_interleaved=False, use_alibi=False,
                 window_size=(-1, -1), use_flash_attn=False, checkpointing=False,
                 sequence_parallel=True, device=None, dtype=None):
        factory = {"device": device, "dtype": dtype}
        nn.Module.__init__(self)
        world_size = torch.distributed.get_world_size(process_group)
        rank = torch.distributed.get_rank(process_group)
        num_heads_kv = num_heads_kv if num_heads_kv is not None else num_heads
        if num_heads % num_heads_kv != 0 or embed_dim % num_heads != 0:
            raise ValueError("ParallelMHA: num_heads must divide embed_dim and be divisible by "
                             "num_heads_kv")
        self.embed_dim, self.head_dim = embed_dim, embed_dim // num_heads
        self.process_group, self.sequence_parallel = process_group, sequence_parallel
        self.num_heads_total, self.num_heads_kv_total = num_heads, num_heads_kv
        self.num_heads = get_dim_for_local_rank(num_heads, world_size, rank)
        self.num_heads_kv = get_dim_for_local_rank(num_heads_kv, world_size, rank)
        if self.num_heads != self.num_heads_kv * (num_heads // num_heads_kv):
            raise ValueError(f"ParallelMHA: {num_heads} heads over {num_heads_kv} kv heads do not "
                             f"split evenly over {world_size} ranks")
        self.cross_attn, self.dwconv, self.causal, self.layer_idx = False, False, causal, layer_idx
        self.rotary_emb_dim, self.use_flash_attn, self.return_residual = rotary_emb_dim, use_flash_attn, False
        self.checkpointing, self.softmax_scale, self.window_size = checkpointing, softmax_scale, window_size

        alibi_slopes = None
        if use_alibi:
            first = sum(get_dim_for_local_rank(num_heads, world_size, r) for r in range(rank))
            alibi_slopes = torch.tensor(get_alibi_slopes(num_heads)[first: first + self.num_heads],
                                        device=device)
        if rotary_emb_dim > 0:
            self._init_rotary(rotary_emb_dim, rotary_emb_base, rotary_emb_scale_base,
                              rotary_emb_interleaved, device)
        group_size = num_heads // num_heads_kv
        qkv_dim = self.head_dim * (num_heads + 2 * num_heads_kv)
        self.Wqkv = ColumnParallelLinear(embed_dim, qkv_dim, process_group, bias=qkv_proj_bias,
                                         sequence_parallel=sequence_parallel,
                                         multiple_of=self.head_dim * (group_size + 2), **factory)
        self._init_inner_attention(use_flash_attn, causal, softmax_scale, dropout, window_size,
                                   alibi_slopes)
        self.out_proj = RowParallelLinear(embed_dim, embed_dim, process_group, bias=out_proj_bias,
                                          sequence_parallel=sequence_parallel,
                                          multiple_of=self.head_dim, **factory)

    def forward(self, x, seqlen=None, inference_params=None, **kwargs):
        qkv = self.Wqkv(x)
        if seqlen is not None:  # rows were (batch * seqlen): restore the sequence axis
            qkv = rearrange(qkv, "(b s) d -> b s d", s=seqlen)
        context = self._context(*self._unpack_qkv(qkv), inference_params).flatten(-2)
        if seqlen is not None:
            context = rearrange(context, "b s d -> (b s) d")
        return self.out_proj(context)
