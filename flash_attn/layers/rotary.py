"""Rotary position embedding (RoPE) for attention: autograd functions over the Triton kernel,
in-place forms for packed qkv / kv tensors, a PyTorch reference and the RotaryEmbedding module.

Backward passes rotate the incoming gradient by minus the angle (the rotation is orthogonal), into
a new tensor: rotating a gradient in place could corrupt a buffer that autograd shares with
another branch of the graph.

The kernel is reached through torch.library ops (flash_attn.ops.triton.rotary), so every function
here, the in-place ones included, also runs under torch.compile (fullgraph=True as well).
apply_rotary_emb_torch is the one PyTorch rotation: the tests' reference, and what RotaryEmbedding
runs on tensors the kernel cannot take (CPU without the Triton interpreter).
"""

from typing import Optional, Tuple, Union

import torch

from flash_attn.ops.triton.launch_device import triton_interpreter_enabled
from flash_attn.ops.triton.rotary import apply_rotary


def rotate_half(x, interleaved=False):
    """(x0, x1) -> (-x1, x0) over the two halves, or over adjacent pairs when interleaved."""
    if interleaved:
        x0, x1 = x[..., 0::2], x[..., 1::2]
        return torch.stack((-x1, x0), dim=-1).flatten(-2)
    x0, x1 = x.chunk(2, dim=-1)
    return torch.cat((-x1, x0), dim=-1)


def _tables_per_row(x, cos, sin, seqlen_offsets, cu_seqlens):
    """cos, sin of the position of every row of x, shaped to broadcast over heads: (s, 1, r) or
    (b, s, 1, r) for x (b, s, h, d); (total, 1, r) for packed x with cu_seqlens. Positions past
    the table turn by 0 (cos 1, sin 0), as the kernel does."""
    if cos.dim() == 3:  # (batch, seqlen, rotary_dim / 2): each sequence's own table, as given
        if cu_seqlens is not None or isinstance(seqlen_offsets, torch.Tensor) or seqlen_offsets:
            raise ValueError("cos: a (batch, seqlen, rotary_dim / 2) table takes no seqlen_offsets "
                             "or cu_seqlens")
        return cos.unsqueeze(-2), sin.unsqueeze(-2)
    seqlen_ro = cos.shape[0]
    if cu_seqlens is None and not isinstance(seqlen_offsets, torch.Tensor):
        if seqlen_offsets + x.shape[1] <= seqlen_ro:  # the common case: one slice of the table
            rows = slice(seqlen_offsets, seqlen_offsets + x.shape[1])
            return cos[rows].unsqueeze(-2), sin[rows].unsqueeze(-2)
    if cu_seqlens is not None:
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
        seq_idx = torch.repeat_interleave(torch.arange(len(lengths), device=x.device), lengths)
        pos = torch.arange(x.shape[0], device=x.device) - cu_seqlens.long()[seq_idx]
    else:
        seq_idx = torch.arange(x.shape[0], device=x.device)[:, None]
        pos = torch.arange(x.shape[1], device=x.device)[None, :]
    if isinstance(seqlen_offsets, torch.Tensor):
        pos = pos + seqlen_offsets.to(x.device).long()[seq_idx]
    else:
        pos = pos + seqlen_offsets
    inside = (pos < seqlen_ro).unsqueeze(-1)
    pos = pos.clamp(max=seqlen_ro - 1)
    cos = torch.where(inside, cos[pos], 1.0)
    sin = torch.where(inside, sin[pos], 0.0)
    return cos.unsqueeze(-2), sin.unsqueeze(-2)


def apply_rotary_emb_torch(x, cos, sin, interleaved=False, seqlen_offsets=0, cu_seqlens=None,
                           conjugate=False):
    """Rotary embedding in plain PyTorch: the reference of the kernel, and its stand-in where the
    kernel cannot run. Computed in the promoted dtype of x and cos.

    x: (batch, seqlen, nheads, headdim), or (total_seqlen, nheads, headdim) with cu_seqlens.
    cos, sin: (seqlen_ro, rotary_dim / 2), or (batch, seqlen, rotary_dim / 2) per sequence.
    seqlen_offsets: int or (batch,) tensor, as in apply_rotary_emb. conjugate: rotate by minus
    the angle (the inverse, which is also the backward). Features past rotary_dim pass through.
    """
    rotary_dim = 2 * cos.shape[-1]
    if rotary_dim > x.shape[-1]:
        raise ValueError(f"cos: expected rotary_dim / 2 <= headdim / 2 = {x.shape[-1] // 2}, got "
                         f"{cos.shape[-1]}")
    cos, sin = _tables_per_row(x, cos, sin, seqlen_offsets, cu_seqlens)
    if conjugate:
        sin = -sin
    # Spread the rotary_dim / 2 angles over the feature layout.
    if interleaved:
        cos, sin = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
    else:
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
    xr = x[..., :rotary_dim]
    return torch.cat((xr * cos + rotate_half(xr, interleaved) * sin, x[..., rotary_dim:]), dim=-1)


def _save_offsets(ctx, seqlen_offsets, *tensors):
    # An int offset is kept on ctx; a tensor one must go through save_for_backward.
    if isinstance(seqlen_offsets, torch.Tensor):
        ctx.save_for_backward(*tensors, seqlen_offsets)
        ctx.seqlen_offsets = None
    else:
        ctx.save_for_backward(*tensors)
        ctx.seqlen_offsets = seqlen_offsets


def _load_offsets(ctx):
    saved = ctx.saved_tensors
    if ctx.seqlen_offsets is None:
        return saved[:-1], saved[-1]
    return saved, ctx.seqlen_offsets


class ApplyRotaryEmb(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0,
                cu_seqlens=None, max_seqlen=None):
        out = apply_rotary(x, cos, sin, seqlen_offsets=seqlen_offsets, cu_seqlens=cu_seqlens,
                           max_seqlen=max_seqlen, interleaved=interleaved, inplace=inplace)
        _save_offsets(ctx, seqlen_offsets, cos, sin, cu_seqlens)
        ctx.interleaved, ctx.max_seqlen = interleaved, max_seqlen
        if inplace:
            ctx.mark_dirty(x)
            return x
        return out

    @staticmethod
    def backward(ctx, dout):
        (cos, sin, cu_seqlens), seqlen_offsets = _load_offsets(ctx)
        dx = apply_rotary(dout, cos, sin, seqlen_offsets=seqlen_offsets, cu_seqlens=cu_seqlens,
                          max_seqlen=ctx.max_seqlen, interleaved=ctx.interleaved, conjugate=True)
        return dx, None, None, None, None, None, None, None


def apply_rotary_emb(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0,
                     cu_seqlens=None, max_seqlen=None):
    """Rotary embedding with autograd.

    x: (batch, seqlen, nheads, headdim), or (total_seqlen, nheads, headdim) with cu_seqlens
        (batch + 1,) and max_seqlen.
    cos, sin: (seqlen_rotary, rotary_dim / 2), rotary_dim <= headdim.
    interleaved: rotate pairs of even and odd features (GPT-J) instead of the first and second
        halves (GPT-NeoX).
    inplace: write the result into x.
    seqlen_offsets: int or (batch,) int tensor; sequence b starts at that position (kv cache).
    Returns out, shaped like x; features past rotary_dim are passed through.
    """
    return ApplyRotaryEmb.apply(x, cos, sin, interleaved, inplace, seqlen_offsets, cu_seqlens,
                                max_seqlen)


# flash-attn's older name for the same function
apply_rotary_emb_func = apply_rotary_emb


def _packed_views(qkv, num_heads_q):
    """q, k, v views of a packed qkv, and q and k as one (b, s, h_q + h_k, d) view when their
    strides allow it (one kernel launch instead of two), else None."""
    if qkv.dim() == 5:
        if qkv.shape[2] != 3:
            raise ValueError("qkv must be (batch, seqlen, 3, nheads, headdim), got "
                             f"{tuple(qkv.shape)}")
        b, s, _, h, d = qkv.shape
        # Single views, not unbind(): autograd lets the PyTorch path rotate them in place.
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        # q and k are one run of 2 * h heads when the qkv axis steps over exactly h heads. A view,
        # not as_strided(..., storage_offset()): torch.compile cannot put storage_offset() in a
        # graph, and a graph break inside the in-place Function breaks compiling it.
        qk = qkv[:, :, :2].view(b, s, 2 * h, d) if qkv.stride(2) == h * qkv.stride(3) else None
        return q, k, v, qk
    if qkv.dim() != 4 or num_heads_q is None:
        raise ValueError("qkv must be (batch, seqlen, 3, nheads, headdim), or (batch, seqlen, "
                         "num_heads_q + 2 * num_heads_k, headdim) with num_heads_q given; got "
                         f"shape {tuple(qkv.shape)}, num_heads_q={num_heads_q}")
    num_heads_k = (qkv.shape[2] - num_heads_q) // 2
    if num_heads_k < 1 or qkv.shape[2] != num_heads_q + 2 * num_heads_k:
        raise ValueError(f"qkv's head axis ({qkv.shape[2]}) must be num_heads_q ({num_heads_q}) "
                         "+ 2 * num_heads_k")
    q = qkv[:, :, :num_heads_q]
    k = qkv[:, :, num_heads_q:num_heads_q + num_heads_k]
    v = qkv[:, :, num_heads_q + num_heads_k:]
    return q, k, v, qkv[:, :, :num_heads_q + num_heads_k]


def _rotate_packed(src, dst, cos, sin, cos_k, sin_k, interleaved, seqlen_offsets, num_heads_q,
                   conjugate):
    """Rotates q and k of packed src into dst (dst may be src); copies v when it is not."""
    q, k, v, qk = _packed_views(src, num_heads_q)
    q_out, k_out, v_out, qk_out = _packed_views(dst, num_heads_q)
    inplace = dst is src
    kwargs = dict(seqlen_offsets=seqlen_offsets, interleaved=interleaved, conjugate=conjugate,
                  inplace=inplace)
    if cos_k is None and sin_k is None and qk is not None and qk_out is not None:
        apply_rotary(qk, cos, sin, out=None if inplace else qk_out, **kwargs)
    else:
        cos_k = cos if cos_k is None else cos_k
        sin_k = sin if sin_k is None else sin_k
        apply_rotary(q, cos, sin, out=None if inplace else q_out, **kwargs)
        apply_rotary(k, cos_k, sin_k, out=None if inplace else k_out, **kwargs)
    if not inplace:
        v_out.copy_(v)
    return dst


class ApplyRotaryEmbQKV_(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, cos, sin, cos_k=None, sin_k=None, interleaved=False, seqlen_offsets=0,
                num_heads_q=None):
        _rotate_packed(qkv, qkv, cos, sin, cos_k, sin_k, interleaved, seqlen_offsets, num_heads_q,
                       conjugate=False)
        _save_offsets(ctx, seqlen_offsets, cos, sin, cos_k, sin_k)
        ctx.interleaved, ctx.num_heads_q = interleaved, num_heads_q
        ctx.mark_dirty(qkv)
        return qkv

    @staticmethod
    def backward(ctx, dqkv):
        (cos, sin, cos_k, sin_k), seqlen_offsets = _load_offsets(ctx)
        dqkv_out = torch.empty(dqkv.shape, dtype=dqkv.dtype, device=dqkv.device)
        _rotate_packed(dqkv, dqkv_out, cos, sin, cos_k, sin_k, ctx.interleaved, seqlen_offsets,
                       ctx.num_heads_q, conjugate=True)
        return dqkv_out, None, None, None, None, None, None, None


def apply_rotary_emb_qkv_(qkv, cos, sin, cos_k=None, sin_k=None, interleaved=False,
                          seqlen_offsets: Union[int, torch.Tensor] = 0, num_heads_q=None):
    """Rotary embedding, in place, on the q and k parts of a packed qkv.

    qkv: (batch, seqlen, 3, nheads, headdim), or (batch, seqlen, num_heads_q + 2 * num_heads_k,
        headdim) for MQA/GQA (num_heads_q required).
    cos, sin: (seqlen, rotary_dim / 2) for q (and k); cos_k, sin_k: optional separate tables
        for k (xPos). interleaved, seqlen_offsets: as in apply_rotary_emb.
    Returns qkv, rotated in place.
    """
    return ApplyRotaryEmbQKV_.apply(qkv, cos, sin, cos_k, sin_k, interleaved, seqlen_offsets,
                                    num_heads_q)


class ApplyRotaryEmbKV_(torch.autograd.Function):
    @staticmethod
    def forward(ctx, kv, cos, sin, interleaved=False, seqlen_offsets=0):
        if kv.dim() != 5 or kv.shape[2] != 2:
            raise ValueError("kv must be (batch, seqlen, 2, nheads_k, headdim), got "
                             f"{tuple(kv.shape)}")
        apply_rotary(kv[:, :, 0], cos, sin, seqlen_offsets=seqlen_offsets,
                     interleaved=interleaved, inplace=True)
        _save_offsets(ctx, seqlen_offsets, cos, sin)
        ctx.interleaved = interleaved
        ctx.mark_dirty(kv)
        return kv

    @staticmethod
    def backward(ctx, dkv):
        (cos, sin), seqlen_offsets = _load_offsets(ctx)
        dkv_out = torch.empty(dkv.shape, dtype=dkv.dtype, device=dkv.device)
        apply_rotary(dkv[:, :, 0], cos, sin, seqlen_offsets=seqlen_offsets,
                     interleaved=ctx.interleaved, conjugate=True, out=dkv_out[:, :, 0])
        dkv_out[:, :, 1].copy_(dkv[:, :, 1])
        return dkv_out, None, None, None, None


def apply_rotary_emb_kv_(kv, cos, sin, interleaved=False,
                         seqlen_offsets: Union[int, torch.Tensor] = 0):
    """Rotary embedding, in place, on k of a packed kv (b, s, 2, nheads_k, headdim); v untouched.
    Returns kv."""
    if torch.compiler.is_compiling():
        # Under torch.compile, k is rotated out of place and copied back with a plain in-place
        # copy, which autograd tracks through kv itself: callers may drop the returned tensor and
        # keep using kv (seen on torch 2.11 + CUDA: the compiled in-place Function's gradient
        # went wrong for such callers).
        if kv.dim() != 5 or kv.shape[2] != 2:
            raise ValueError("kv must be (batch, seqlen, 2, nheads_k, headdim), got "
                             f"{tuple(kv.shape)}")
        kv[:, :, 0].copy_(apply_rotary_emb(kv[:, :, 0], cos, sin, interleaved=interleaved,
                                           seqlen_offsets=seqlen_offsets))
        return kv
    return ApplyRotaryEmbKV_.apply(kv, cos, sin, interleaved, seqlen_offsets)


class RotaryEmbedding(torch.nn.Module):
    """Rotary position embedding (RoFormer, https://arxiv.org/abs/2104.09864), with optional
    xPos scaling (https://arxiv.org/abs/2212.10554) when scale_base is set.

    interleaved: rotate pairs of even and odd features (GPT-J) instead of the two halves
        (GPT-NeoX).
    pos_idx_in_fp32: build position indices in fp32. When False they take inv_freq's dtype,
        which reproduces models trained in pure bf16, where nearby positions collide.
    The cos/sin tables are cached, rebuilt when a longer sequence, another device or dtype, or
    training after inference mode asks for it. CUDA tensors (and CPU ones under the Triton
    interpreter) are rotated by the Triton kernel, other CPU tensors by apply_rotary_emb_torch.
    """

    def __init__(self, dim: int, base=10000.0, interleaved=False, scale_base=None,
                 pos_idx_in_fp32=True, device=None):
        super().__init__()
        self.dim = dim
        self.base = float(base)
        self.pos_idx_in_fp32 = pos_idx_in_fp32
        self.register_buffer("inv_freq", self._compute_inv_freq(device), persistent=False)
        self.interleaved = interleaved
        self.scale_base = scale_base
        scale = None
        if scale_base is not None:
            scale = ((torch.arange(0, dim, 2, device=device, dtype=torch.float32) + 0.4 * dim)
                     / (1.4 * dim))
        self.register_buffer("scale", scale, persistent=False)
        self._seq_len_cached = 0
        self._cos_cached = None
        self._sin_cached = None
        self._cos_k_cached = None
        self._sin_k_cached = None

    def _compute_inv_freq(self, device=None):
        exponents = torch.arange(0, self.dim, 2, device=device, dtype=torch.float32) / self.dim
        return 1.0 / (self.base ** exponents)

    def _update_cos_sin_cache(self, seqlen, device=None, dtype=None):
        if not (seqlen > self._seq_len_cached or self._cos_cached is None
                or self._cos_cached.device != device or self._cos_cached.dtype != dtype
                or (self.training and self._cos_cached.is_inference())):
            return
        self._seq_len_cached = seqlen
        if self.pos_idx_in_fp32:
            # Positions times frequencies reach large values: fp32, even in a bf16 model.
            t = torch.arange(seqlen, device=device, dtype=torch.float32)
            inv_freq = self.inv_freq
            if inv_freq.dtype != torch.float32:
                inv_freq = self._compute_inv_freq(device=device)
        else:
            t = torch.arange(seqlen, device=device, dtype=self.inv_freq.dtype)
            inv_freq = self.inv_freq
        # outer, not einsum: autocast would run einsum in half precision.
        freqs = torch.outer(t, inv_freq.to(device=t.device))
        if self.scale is None:
            self._cos_cached = torch.cos(freqs).to(dtype)
            self._sin_cached = torch.sin(freqs).to(dtype)
            return
        # xPos: q scaled by scale^(n / scale_base), k by its inverse, n centred on the table.
        power = (torch.arange(seqlen, dtype=self.scale.dtype, device=self.scale.device)
                 - seqlen // 2) / self.scale_base
        scale = (self.scale.to(device=power.device) ** power.unsqueeze(-1)).to(freqs.device)
        self._cos_cached = (torch.cos(freqs) * scale).to(dtype)
        self._sin_cached = (torch.sin(freqs) * scale).to(dtype)
        self._cos_k_cached = (torch.cos(freqs) / scale).to(dtype)
        self._sin_k_cached = (torch.sin(freqs) / scale).to(dtype)

    def forward(self, qkv: torch.Tensor, kv: Optional[torch.Tensor] = None,
                seqlen_offset: Union[int, torch.Tensor] = 0, max_seqlen: Optional[int] = None,
                num_heads_q: Optional[int] = None
                ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        """Rotates q and k in place.

        qkv: (batch, seqlen, 3, nheads, headdim), or (batch, seqlen, num_heads_q + 2 *
            num_heads_k, headdim) with num_heads_q given; or only q (batch, seqlen, nheads,
            headdim) when kv is given.
        kv: (batch, seqlen, 2, nheads_k, headdim).
        seqlen_offset: int or (batch,) tensor: sequence b starts at that position (kv cache).
            With a tensor, pass max_seqlen so that the cache covers every position.
        Returns qkv, or (q, kv) when kv is given.
        """
        seqlen = qkv.shape[1]
        if max_seqlen is not None:
            self._update_cos_sin_cache(max_seqlen, device=qkv.device, dtype=qkv.dtype)
        elif isinstance(seqlen_offset, int):
            self._update_cos_sin_cache(seqlen + seqlen_offset, device=qkv.device, dtype=qkv.dtype)
        if not _kernel_takes(qkv):
            return self._rotate_torch(qkv, kv, seqlen_offset, num_heads_q)
        if kv is None:
            return apply_rotary_emb_qkv_(qkv, self._cos_cached, self._sin_cached,
                                         self._cos_k_cached, self._sin_k_cached,
                                         interleaved=self.interleaved,
                                         seqlen_offsets=seqlen_offset, num_heads_q=num_heads_q)
        q = apply_rotary_emb(qkv, self._cos_cached, self._sin_cached,
                             interleaved=self.interleaved, inplace=True,
                             seqlen_offsets=seqlen_offset)
        cos_k = self._cos_cached if self.scale is None else self._cos_k_cached
        sin_k = self._sin_cached if self.scale is None else self._sin_k_cached
        kv = apply_rotary_emb_kv_(kv, cos_k, sin_k, interleaved=self.interleaved,
                                  seqlen_offsets=seqlen_offset)
        return q, kv

    def _rotate_torch(self, qkv, kv, seqlen_offset, num_heads_q):
        """forward's rotation in PyTorch (apply_rotary_emb_torch), in place and in fp32 as the
        kernel's, for tensors the Triton kernel cannot take."""
        cos_k = self._cos_cached if self.scale is None else self._cos_k_cached
        sin_k = self._sin_cached if self.scale is None else self._sin_k_cached

        def rotate_(x, cos, sin):
            rotated = x[..., :2 * cos.shape[-1]]
            rotated.copy_(apply_rotary_emb_torch(rotated.float(), cos.float(), sin.float(),
                                                 self.interleaved, seqlen_offsets=seqlen_offset))

        if kv is None:
            q, k, _, _ = _packed_views(qkv, num_heads_q)
        else:
            q, k = qkv, kv[:, :, 0]
        rotate_(q, self._cos_cached, self._sin_cached)
        rotate_(k, cos_k, sin_k)
        return qkv if kv is None else (qkv, kv)


def _kernel_takes(x):
    """Whether the Triton kernel runs on x: a CUDA tensor, or a CPU one under the interpreter.
    While torch.compile traces, always (the kernel is an opaque op there; reading the
    interpreter setting would break the graph)."""
    return x.is_cuda or torch.compiler.is_compiling() or triton_interpreter_enabled()
