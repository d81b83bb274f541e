"""The inner attention modules MHA picks from: the flash kernels (FlashSelfAttention,
FlashCrossAttention: CUDA, fp16/bf16) or the plain PyTorch reference (SelfAttention,
CrossAttention: any device and dtype), with the same causal / window / alibi / GQA semantics.

The reference modules compute with flash_attn.utils.testing.attention_ref, the one fp32 oracle
the kernel tests check against, so the CPU path and the tests cannot drift apart.
"""

import torch
import torch.nn as nn

from flash_attn import flash_attn_interface as fai
from flash_attn.utils.testing import attention_ref


class _InnerAttention(nn.Module):
    """The settings shared by the inner attention modules, reference and flash alike."""

    def __init__(self, causal=False, softmax_scale=None, attention_dropout=0.0,
                 window_size=(-1, -1), alibi_slopes=None, deterministic=False):
        super().__init__()
        self.causal, self.softmax_scale, self.window_size = causal, softmax_scale, window_size
        self.drop = nn.Dropout(attention_dropout)
        self.deterministic = deterministic
        self.register_buffer("alibi_slopes", alibi_slopes, persistent=False)

    def _kwargs(self, causal):
        """Keyword arguments of one attention call; causal=None keeps the module's setting."""
        return dict(causal=self.causal if causal is None else causal,
                    softmax_scale=self.softmax_scale,
                    dropout_p=self.drop.p if self.training else 0.0,
                    window_size=self.window_size, alibi_slopes=self.alibi_slopes)


# ----------------------------------------------------------------------------------------------
# Reference attention in PyTorch.
# ----------------------------------------------------------------------------------------------


class SelfAttention(_InnerAttention):
    """Reference self-attention. qkv (b, s, 3, h, d), or (total, 3, h, d) with cu_seqlens."""

    def forward(self, qkv, causal=None, key_padding_mask=None, cu_seqlens=None, max_seqlen=None):
        """key_padding_mask (b, s) bool, True = real token; queries share it, so the causal
        diagonal stays at key i for query i (padded queries give 0)."""
        q, k, v = qkv.unbind(dim=-3)
        return _reference_call(self, q, k, v, causal, key_padding_mask, cu_seqlens, max_seqlen,
                               cu_seqlens, max_seqlen, query_padding_mask=key_padding_mask)


class CrossAttention(_InnerAttention):
    """Reference attention of q (b, s_q, h, d) to kv (b, s_k, 2, h_k, d) (or packed varlen)."""

    def forward(self, q, kv, causal=None, key_padding_mask=None, cu_seqlens=None, max_seqlen=None,
                cu_seqlens_k=None, max_seqlen_k=None, query_padding_mask=None):
        """Without query_padding_mask every query is real, and the causal diagonal of query i
        sits at key i + len_k - s_q (bottom-right, e.g. new tokens against a kv cache)."""
        k, v = kv.unbind(dim=-3)
        return _reference_call(self, q, k, v, causal, key_padding_mask, cu_seqlens, max_seqlen,
                               cu_seqlens_k, max_seqlen_k, query_padding_mask)


def _reference_call(module, q, k, v, causal, key_padding_mask, cu_seqlens_q, max_seqlen_q,
                    cu_seqlens_k, max_seqlen_k, query_padding_mask=None):
    kwargs = module._kwargs(causal)
    if cu_seqlens_q is None:
        return _attention_with_dropout(q, k, v, query_padding_mask, key_padding_mask, **kwargs)
    # Varlen: pad each sequence to the batch's longest, attend with masks, re-pack.
    q_pad, q_valid = _pad_varlen(q, cu_seqlens_q, max_seqlen_q)
    k_pad, k_valid = _pad_varlen(k, cu_seqlens_k, max_seqlen_k)
    v_pad, _ = _pad_varlen(v, cu_seqlens_k, max_seqlen_k)
    return _attention_with_dropout(q_pad, k_pad, v_pad, q_valid, k_valid, **kwargs)[q_valid]


def _attention_with_dropout(q, k, v, query_padding_mask, key_padding_mask, dropout_p, **kwargs):
    """attention_ref's output, with a freshly drawn dropout keep-mask when dropout_p > 0."""
    dropout_mask = None
    if dropout_p > 0.0:
        batch, seqlen_q, nheads, _ = q.shape
        dropout_mask = torch.rand(batch, nheads, seqlen_q, k.shape[1], device=q.device) >= dropout_p
    out, _ = attention_ref(q, k, v, query_padding_mask, key_padding_mask, dropout_p=dropout_p,
                           dropout_mask=dropout_mask, **kwargs)
    return out


def _pad_varlen(x, cu_seqlens, max_seqlen):
    """(total, ...) packed rows -> (batch, max_seqlen, ...) zero-padded, and the (batch,
    max_seqlen) mask of real rows."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    pos = torch.arange(max_seqlen, device=x.device)
    valid = pos.unsqueeze(0) < lengths.unsqueeze(1)
    index = (cu_seqlens[:-1].unsqueeze(1).long() + pos).clamp(max=x.shape[0] - 1)
    padded = x[index] * valid.view(*valid.shape, *([1] * (x.dim() - 1))).to(x.dtype)
    return padded, valid


# ----------------------------------------------------------------------------------------------
# Flash attention modules (CUDA kernels).
# ----------------------------------------------------------------------------------------------


def fp32_slopes(alibi_slopes):
    """The kernels take fp32 slopes; model.to(bfloat16) converts float buffers too."""
    return alibi_slopes.float() if alibi_slopes is not None else None


class _FlashInnerAttention(_InnerAttention):
    """The kernels' call also takes deterministic (for the backward) and fp32 slopes."""

    def _kwargs(self, causal):
        return dict(super()._kwargs(causal), alibi_slopes=fp32_slopes(self.alibi_slopes),
                    deterministic=self.deterministic)


class FlashSelfAttention(_FlashInnerAttention):
    """qkv (b, s, 3, h, d), or (total, 3, h, d) with cu_seqlens (b+1,) int32 and max_seqlen."""

    def forward(self, qkv, causal=None, cu_seqlens=None, max_seqlen=None):
        kwargs = self._kwargs(causal)
        if cu_seqlens is None:
            return fai.flash_attn_qkvpacked_func(qkv, **kwargs)
        return fai.flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, **kwargs)


class FlashCrossAttention(_FlashInnerAttention):
    """q (b, s_q, h, d), kv (b, s_k, 2, h_k, d); or packed (total, ...) with cu_seqlens(_k)."""

    def forward(self, q, kv, causal=None, cu_seqlens=None, max_seqlen=None, cu_seqlens_k=None,
                max_seqlen_k=None):
        kwargs = self._kwargs(causal)
        if cu_seqlens is None:
            return fai.flash_attn_kvpacked_func(q, kv, **kwargs)
        return fai.flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens, cu_seqlens_k, max_seqlen,
                                                   max_seqlen_k, **kwargs)
