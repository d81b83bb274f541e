"""flash_attn.layers.rotary: autograd functions, packed in-place forms and RotaryEmbedding against
the plain-PyTorch apply_rotary_emb_torch (outputs and gradients), which is itself checked against
complex multiplication."""

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from flash_attn.layers.rotary import (
    RotaryEmbedding,
    apply_rotary_emb,
    apply_rotary_emb_kv_,
    apply_rotary_emb_qkv_,
    apply_rotary_emb_torch,
)
from flash_attn.utils.testing import rotary_tables, triton_interpreter_slack

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _assert_close_to_ref(ours, ref_fp32, ref_lowp):
    """ours vs the fp32 reference: at most 2x the error of the reference run in ours' dtype."""
    err = (ours.float() - ref_fp32).abs().max().item()
    err_lowp = (ref_lowp.float() - ref_fp32).abs().max().item()
    slack = triton_interpreter_slack(ours.dtype, ref_fp32)
    assert err <= 2 * err_lowp + 1e-5 + slack, (err, err_lowp)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim", [32, 16])
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("offsets_kind", ["zero", "int", "tensor"])
def test_apply_rotary_emb_forward_backward(dtype, interleaved, rotary_dim, inplace, offsets_kind):
    torch.manual_seed(0)
    b, s, h, d = 2, 9, 3, 32
    x = torch.randn(b, s, h, d, device=DEVICE, dtype=dtype, requires_grad=True)
    cos, sin = rotary_tables(s + 6, rotary_dim, DEVICE, dtype)
    offsets = {"zero": 0, "int": 4,
               "tensor": torch.tensor([5, 1], device=DEVICE, dtype=torch.int32)}[offsets_kind]
    g = torch.randn(b, s, h, d, device=DEVICE, dtype=dtype)
    # In place needs a non-leaf input, as any in-place op does.
    x_in = x.clone() if inplace else x
    out = apply_rotary_emb(x_in, cos, sin, interleaved=interleaved, inplace=inplace,
                           seqlen_offsets=offsets)
    if inplace:
        assert out.data_ptr() == x_in.data_ptr()
    out.backward(g)

    refs = []
    for prec in (torch.float32, dtype):
        xr = x.detach().to(prec).requires_grad_()
        ref = apply_rotary_emb_torch(xr, cos.to(prec), sin.to(prec), interleaved,
                                     seqlen_offsets=offsets)
        ref.backward(g.to(prec))
        refs.append((ref.detach(), xr.grad))
    _assert_close_to_ref(out.detach(), refs[0][0], refs[1][0])
    _assert_close_to_ref(x.grad, refs[0][1], refs[1][1])


def _rotate_complex(x, angle, interleaved):
    """x (..., d) turned pair by pair by angle (..., r / 2) as complex multiplication by
    exp(i * angle); features past r pass through."""
    rotary_dim = 2 * angle.shape[-1]
    xr = x[..., :rotary_dim].double()
    if interleaved:
        re, im = xr[..., 0::2], xr[..., 1::2]
    else:
        re, im = xr.chunk(2, dim=-1)
    z = torch.complex(re, im) * torch.polar(torch.ones_like(angle), angle)
    rotated = (torch.stack((z.real, z.imag), -1).flatten(-2) if interleaved
               else torch.cat((z.real, z.imag), -1))
    return torch.cat((rotated.to(x.dtype), x[..., rotary_dim:]), dim=-1)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("conjugate", [False, True])
def test_torch_reference_matches_complex_multiplication(interleaved, conjugate):
    """apply_rotary_emb_torch, independently: int and per-sequence offsets, varlen, positions
    past the table (turned by 0), conjugate (minus the angle)."""
    torch.manual_seed(0)
    sign = -1.0 if conjugate else 1.0
    angle = torch.rand(9, 6, dtype=torch.float64) * 6.28  # table of 9 positions, rotary_dim 12
    cos, sin = angle.cos(), angle.sin()
    # past the table: angle 0
    angle_at = lambda pos: torch.where((pos < 9)[..., None], angle[pos.clamp(max=8)], 0.0)  # noqa: E731
    x = torch.randn(2, 7, 3, 16, dtype=torch.float64)
    for offsets in (0, 4, torch.tensor([5, 1])):
        pos = torch.arange(7) + (offsets.view(-1, 1) if isinstance(offsets, torch.Tensor) else offsets)
        expected = _rotate_complex(x, sign * angle_at(pos.expand(2, 7))[:, :, None], interleaved)
        torch.testing.assert_close(apply_rotary_emb_torch(x, cos, sin, interleaved,
                                                          seqlen_offsets=offsets,
                                                          conjugate=conjugate), expected)
    cu_seqlens = torch.tensor([0, 3, 10, 11], dtype=torch.int32)
    packed = torch.randn(11, 2, 16, dtype=torch.float64)
    offsets = torch.tensor([0, 1, 6])
    pos = torch.cat([torch.arange(n) + o for n, o in zip((3, 7, 1), offsets.tolist())])
    expected = _rotate_complex(packed, sign * angle_at(pos)[:, None], interleaved)
    torch.testing.assert_close(apply_rotary_emb_torch(packed, cos, sin, interleaved,
                                                      seqlen_offsets=offsets,
                                                      cu_seqlens=cu_seqlens,
                                                      conjugate=conjugate), expected)
    # One table per sequence, (batch, seqlen, rotary_dim / 2), as flash-attn's reference takes it.
    per_seq = torch.rand(2, 7, 6, dtype=torch.float64)
    torch.testing.assert_close(apply_rotary_emb_torch(x, per_seq.cos(), per_seq.sin(), interleaved,
                                                      conjugate=conjugate),
                               _rotate_complex(x, sign * per_seq[:, :, None], interleaved))


def test_torch_reference_rejects_bad_tables():
    x = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match="cos"):
        apply_rotary_emb_torch(x, torch.ones(4, 5), torch.zeros(4, 5))  # rotary_dim 10 > 8
    with pytest.raises(ValueError, match="cos"):
        apply_rotary_emb_torch(x, torch.ones(1, 4, 2), torch.zeros(1, 4, 2), seqlen_offsets=1)


@pytest.mark.parametrize("interleaved", [False, True])
def test_kernel_matches_torch_reference(interleaved):
    torch.manual_seed(0)
    x = torch.randn(2, 7, 3, 16, device=DEVICE)
    cos, sin = rotary_tables(7, 12, DEVICE)
    torch.testing.assert_close(apply_rotary_emb(x, cos, sin, interleaved),
                               apply_rotary_emb_torch(x, cos, sin, interleaved))


def test_apply_rotary_emb_varlen_backward():
    torch.manual_seed(0)
    cu_seqlens = torch.tensor([0, 3, 10, 11], dtype=torch.int32, device=DEVICE)
    x = torch.randn(11, 2, 16, device=DEVICE, requires_grad=True)
    cos, sin = rotary_tables(8, 16, DEVICE)
    offsets = torch.tensor([0, 1, 6], device=DEVICE)
    g = torch.randn_like(x)
    apply_rotary_emb(x, cos, sin, seqlen_offsets=offsets, cu_seqlens=cu_seqlens,
                     max_seqlen=7).backward(g)
    xr = x.detach().clone().requires_grad_()
    apply_rotary_emb_torch(xr, cos, sin, seqlen_offsets=offsets, cu_seqlens=cu_seqlens).backward(g)
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-5, atol=1e-5)


def _qkv_reference(qkv, cos, sin, cos_k, sin_k, interleaved, offsets, num_heads_q=None):
    """Reference rotation of packed qkv: returns the rotated packed tensor (differentiable)."""
    if qkv.dim() == 5:
        q, k, v = qkv.unbind(2)
    else:
        h_k = (qkv.shape[2] - num_heads_q) // 2
        q, k, v = qkv.split([num_heads_q, h_k, h_k], dim=2)
    q = apply_rotary_emb_torch(q, cos, sin, interleaved, seqlen_offsets=offsets)
    k = apply_rotary_emb_torch(k, cos if cos_k is None else cos_k, sin if sin_k is None else sin_k,
                               interleaved, seqlen_offsets=offsets)
    return torch.stack((q, k, v), dim=2) if qkv.dim() == 5 else torch.cat((q, k, v), dim=2)


@pytest.mark.parametrize("layout", ["packed", "strided", "gqa"])
@pytest.mark.parametrize("separate_k_tables", [False, True])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("offsets_kind", ["int", "tensor"])
def test_apply_rotary_emb_qkv_(layout, separate_k_tables, interleaved, offsets_kind):
    torch.manual_seed(0)
    b, s, h, d, rotary_dim = 2, 6, 2, 16, 12
    num_heads_q = None
    if layout == "packed":
        base = torch.randn(b, s, 3, h, d, device=DEVICE, requires_grad=True)
        make = lambda t: t * 1.0  # noqa: E731  (non-leaf, contiguous)
    elif layout == "strided":
        # (b, s, h, 3, d) seen as (b, s, 3, h, d): q and k cannot be merged into one view.
        base = torch.randn(b, s, h, 3, d, device=DEVICE, requires_grad=True)
        make = lambda t: (t * 1.0).transpose(2, 3)  # noqa: E731
    else:
        num_heads_q = 4  # with 1 k/v head: (b, s, 4 + 2 * 1, d)
        base = torch.randn(b, s, num_heads_q + 2, d, device=DEVICE, requires_grad=True)
        make = lambda t: t * 1.0  # noqa: E731
    cos, sin = rotary_tables(s + 3, rotary_dim, DEVICE)
    cos_k, sin_k = rotary_tables(s + 3, rotary_dim, DEVICE) if separate_k_tables else (None, None)
    offsets = 3 if offsets_kind == "int" else torch.tensor([0, 2], device=DEVICE)
    g = torch.randn_like(make(base.detach()))

    qkv = make(base)
    out = apply_rotary_emb_qkv_(qkv, cos, sin, cos_k, sin_k, interleaved=interleaved,
                                seqlen_offsets=offsets, num_heads_q=num_heads_q)
    assert out.data_ptr() == qkv.data_ptr()
    out.backward(g)

    base_ref = base.detach().clone().requires_grad_()
    ref = _qkv_reference(make(base_ref), cos, sin, cos_k, sin_k, interleaved, offsets,
                         num_heads_q)
    ref.backward(g)
    torch.testing.assert_close(out.detach(), ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(base.grad, base_ref.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("interleaved", [False, True])
def test_apply_rotary_emb_kv_(interleaved):
    torch.manual_seed(0)
    base = torch.randn(2, 5, 2, 3, 16, device=DEVICE, requires_grad=True)
    cos, sin = rotary_tables(8, 16, DEVICE)
    offsets = torch.tensor([1, 3], device=DEVICE)
    g = torch.randn_like(base)
    kv = base * 1.0
    v_before = kv[:, :, 1].detach().clone()
    apply_rotary_emb_kv_(kv, cos, sin, interleaved=interleaved, seqlen_offsets=offsets).backward(g)
    assert torch.equal(kv[:, :, 1].detach(), v_before)

    base_ref = base.detach().clone().requires_grad_()
    k, v = base_ref.unbind(2)
    ref = torch.stack((apply_rotary_emb_torch(k, cos, sin, interleaved, seqlen_offsets=offsets),
                       v), dim=2)
    ref.backward(g)
    torch.testing.assert_close(kv.detach(), ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(base.grad, base_ref.grad, rtol=1e-5, atol=1e-5)


def test_backward_leaves_shared_gradient_untouched():
    # y = rot(qkv) + w: autograd hands the same gradient tensor to both branches.
    torch.manual_seed(0)
    base = torch.randn(1, 4, 3, 2, 8, device=DEVICE, requires_grad=True)
    w = torch.randn(1, 4, 3, 2, 8, device=DEVICE, requires_grad=True)
    cos, sin = rotary_tables(4, 8, DEVICE)
    g = torch.randn_like(base)
    (apply_rotary_emb_qkv_(base * 1.0, cos, sin) + w).backward(g)
    torch.testing.assert_close(w.grad, g, rtol=0, atol=0)


# ------------------------------------------------------------------------------------------
# RotaryEmbedding
# ------------------------------------------------------------------------------------------


def test_rotary_embedding_tables_and_cache():
    rot = RotaryEmbedding(16, base=500.0, device=DEVICE)
    qkv = torch.randn(1, 5, 3, 2, 16, device=DEVICE)
    rot(qkv)
    t = torch.arange(5, dtype=torch.float64)[:, None]
    inv_freq = 500.0 ** (-torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    torch.testing.assert_close(rot._cos_cached.cpu().double(), torch.cos(t * inv_freq))
    torch.testing.assert_close(rot._sin_cached.cpu().double(), torch.sin(t * inv_freq))
    assert rot._seq_len_cached == 5
    # Grows on demand (offset included), kept for shorter calls, rebuilt for another dtype.
    rot(torch.randn(1, 4, 3, 2, 16, device=DEVICE), seqlen_offset=6)
    assert rot._seq_len_cached == 10 and rot._cos_cached.shape == (10, 8)
    cached = rot._cos_cached
    rot(torch.randn(1, 3, 3, 2, 16, device=DEVICE))
    assert rot._cos_cached is cached
    rot(torch.randn(1, 3, 3, 2, 16, device=DEVICE, dtype=torch.bfloat16))
    assert rot._cos_cached.dtype == torch.bfloat16


def test_rotary_embedding_rebuilds_inference_cache_for_training():
    rot = RotaryEmbedding(8, device=DEVICE)
    with torch.inference_mode():
        rot(torch.randn(1, 4, 3, 1, 8, device=DEVICE))
    assert rot._cos_cached.is_inference()
    rot.train()
    rot(torch.randn(1, 4, 3, 1, 8, device=DEVICE))
    assert not rot._cos_cached.is_inference()


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_embedding_forward_paths(interleaved):
    torch.manual_seed(0)
    b, s, h, d = 2, 6, 2, 16
    rot = RotaryEmbedding(12, interleaved=interleaved, device=DEVICE)
    qkv = torch.randn(b, s, 3, h, d, device=DEVICE)
    expected_q = lambda x, off: apply_rotary_emb_torch(  # noqa: E731
        x, rot._cos_cached[off:off + s], rot._sin_cached[off:off + s], interleaved)

    out = rot(qkv.clone(), seqlen_offset=2)
    torch.testing.assert_close(out[:, :, 0], expected_q(qkv[:, :, 0], 2))
    torch.testing.assert_close(out[:, :, 1], expected_q(qkv[:, :, 1], 2))
    torch.testing.assert_close(out[:, :, 2], qkv[:, :, 2], rtol=0, atol=0)

    q, kv = rot(qkv[:, :, 0].clone(), kv=qkv[:, :, 1:].clone(), seqlen_offset=2)
    torch.testing.assert_close(q, out[:, :, 0])
    torch.testing.assert_close(kv, out[:, :, 1:])

    # GQA packing (b, s, h_q + 2 h_k, d) with a per-sequence offset tensor.
    gqa = torch.randn(b, s, 4 + 2, d, device=DEVICE)
    offsets = torch.tensor([0, 3], device=DEVICE)
    out = rot(gqa.clone(), seqlen_offset=offsets, max_seqlen=s + 3, num_heads_q=4)
    assert rot._seq_len_cached == s + 3
    for i in range(b):
        off = int(offsets[i])
        torch.testing.assert_close(out[i:i + 1, :, :5], expected_q(gqa[i:i + 1, :, :5], off))
    torch.testing.assert_close(out[:, :, 5:], gqa[:, :, 5:], rtol=0, atol=0)


def test_rotary_embedding_xpos():
    torch.manual_seed(0)
    dim, scale_base, s = 16, 64, 10
    rot = RotaryEmbedding(dim, scale_base=scale_base, device=DEVICE)
    qkv = torch.randn(1, s, 3, 2, dim, device=DEVICE)
    out = rot(qkv.clone())
    # q scaled by zeta^((n - s // 2) / scale_base), k by its inverse.
    zeta = (torch.arange(0, dim, 2, dtype=torch.float64) + 0.4 * dim) / (1.4 * dim)
    power = (torch.arange(s, dtype=torch.float64) - s // 2)[:, None] / scale_base
    freqs = torch.arange(s, dtype=torch.float64)[:, None] * 10000.0 ** (
        -torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    scale = zeta ** power
    cos_q, sin_q = (freqs.cos() * scale).float(), (freqs.sin() * scale).float()
    cos_k, sin_k = (freqs.cos() / scale).float(), (freqs.sin() / scale).float()
    q_ref = apply_rotary_emb_torch(qkv[:, :, 0].cpu(), cos_q, sin_q)
    k_ref = apply_rotary_emb_torch(qkv[:, :, 1].cpu(), cos_k, sin_k)
    torch.testing.assert_close(out[:, :, 0].cpu(), q_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[:, :, 1].cpu(), k_ref, rtol=1e-5, atol=1e-5)
    # The q.k product then depends on the relative position only, scale included.
    q_kv = rot(qkv[:, :, 0].clone(), kv=qkv[:, :, 1:].clone())
    torch.testing.assert_close(q_kv[1][:, :, 0], out[:, :, 1], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("layout", ["packed", "gqa", "q_kv"])
@pytest.mark.parametrize("scale_base", [None, 64])
def test_rotary_embedding_torch_path_matches_kernel(layout, scale_base, monkeypatch):
    """CPU tensors without the Triton interpreter: the same rotation in PyTorch, in place."""
    torch.manual_seed(0)
    b, s, d = 2, 6, 16
    inputs = {"packed": (torch.randn(b, s, 3, 2, d),), "gqa": (torch.randn(b, s, 4 + 2, d),),
              "q_kv": (torch.randn(b, s, 4, d), torch.randn(b, s, 2, 1, d))}[layout]
    num_heads_q = 4 if layout == "gqa" else None

    def rotate(device):
        rot = RotaryEmbedding(12, scale_base=scale_base, device=device)
        tensors = [t.to(device) for t in inputs]
        out = rot(*tensors, seqlen_offset=torch.tensor([0, 3], device=device), max_seqlen=s + 3,
                  num_heads_q=num_heads_q)
        out = out if isinstance(out, tuple) else (out,)
        assert all(o.data_ptr() == t.data_ptr() for o, t in zip(out, tensors))  # in place
        return [o.cpu() for o in out]

    kernel = rotate(DEVICE)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    for got, want in zip(rotate("cpu"), kernel):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_pos_idx_in_fp32():
    # In a pure-bf16 model inv_freq is bf16; bf16 positions collide above 256 (257 -> 256).
    qkv = torch.randn(1, 300, 3, 1, 8, device=DEVICE, dtype=torch.bfloat16)
    exact = RotaryEmbedding(8, device=DEVICE).to(torch.bfloat16)
    legacy = RotaryEmbedding(8, pos_idx_in_fp32=False, device=DEVICE).to(torch.bfloat16)
    assert exact.inv_freq.dtype == torch.bfloat16
    exact._update_cos_sin_cache(300, device=qkv.device, dtype=torch.float32)
    legacy._update_cos_sin_cache(300, device=qkv.device, dtype=torch.float32)
    assert torch.equal(legacy._cos_cached[256], legacy._cos_cached[257])
    assert not torch.equal(exact._cos_cached[256], exact._cos_cached[257])
    t = torch.tensor([257.0], dtype=torch.float64)
    inv_freq = 10000.0 ** (-torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    torch.testing.assert_close(exact._cos_cached[257].cpu().double(), torch.cos(t * inv_freq),
                               rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------------------
# torch.compile: the in-place forms where models use them, on a projection of a leaf weight
# ------------------------------------------------------------------------------------------

_B, _S, _D, _ROTARY_DIM = 2, 5, 8, 6
_MAX_OFFSET = 3  # the tables cover _S + _MAX_OFFSET positions
# entry: (heads of the projection, of which the first ones are rotated)
_ENTRY_HEADS = {
    "qkv_": (3 * 2, 2 * 2),    # apply_rotary_emb_qkv_ on (b, s, 3, 2, d), result returned
    "kv_": (2 * 2, 2),         # apply_rotary_emb_kv_ on (b, s, 2, 2, d), result discarded
    "inplace": (2, 2),         # apply_rotary_emb(inplace=True) on (b, s, 2, d)
    "module": (4 + 2, 4 + 1),  # RotaryEmbedding on GQA-packed (b, s, 4 + 2 * 1, d)
}


def _compile_offsets(kind, device):
    return 2 if kind == "int" else torch.tensor([_MAX_OFFSET, 1], device=device,
                                                dtype=torch.int32)


def _rotary_forward(entry, cos, sin, rotary_module):
    """f(x, weight, offsets): project x, rotate in place through entry, return the result."""
    heads, _ = _ENTRY_HEADS[entry]

    def forward(x, weight, offsets):
        proj = torch.nn.functional.linear(x, weight).view(_B, _S, heads, _D)
        if entry == "qkv_":
            return apply_rotary_emb_qkv_(proj.view(_B, _S, 3, heads // 3, _D), cos, sin,
                                         seqlen_offsets=offsets)
        if entry == "kv_":
            kv = proj.view(_B, _S, 2, heads // 2, _D)
            apply_rotary_emb_kv_(kv, cos, sin, seqlen_offsets=offsets)  # kv itself is used
            return kv
        if entry == "inplace":
            return apply_rotary_emb(proj, cos, sin, inplace=True, seqlen_offsets=offsets)
        return rotary_module(proj, seqlen_offset=offsets, max_seqlen=_S + _MAX_OFFSET,
                             num_heads_q=4)

    return forward


def _rotary_forward_ref(entry, cos, sin):
    """The same function out of place in plain PyTorch (apply_rotary_emb_torch)."""
    heads, rotated = _ENTRY_HEADS[entry]

    def forward(x, weight, offsets):
        proj = torch.nn.functional.linear(x, weight).view(_B, _S, heads, _D)
        rot = apply_rotary_emb_torch(proj[:, :, :rotated], cos, sin, seqlen_offsets=offsets)
        return torch.cat((rot, proj[:, :, rotated:]), dim=2)

    return forward


def _forward_backward(forward, x, weight, offsets, grad):
    x, weight = x.clone().requires_grad_(), weight.clone().requires_grad_()
    out = forward(x, weight, offsets)
    out.backward(grad.view(out.shape))
    return out.detach().reshape(grad.shape), x.grad, weight.grad


def _check_compiled_rotary(entry, offsets_kind, backend, fullgraph, device):
    torch.manual_seed(0)
    heads, _ = _ENTRY_HEADS[entry]
    x = torch.randn(_B, _S, 16, device=device)
    weight = torch.randn(heads * _D, 16, device=device) / 4
    grad = torch.randn(_B, _S, heads, _D, device=device)
    offsets = _compile_offsets(offsets_kind, device)
    if entry == "module":
        # One module per run, so that the compiled run builds its tables inside the graph.
        modules = [RotaryEmbedding(_ROTARY_DIM, device=device) for _ in range(2)]
        tables = RotaryEmbedding(_ROTARY_DIM, device=device)
        tables._update_cos_sin_cache(_S + _MAX_OFFSET, device=x.device, dtype=x.dtype)
        cos, sin = tables._cos_cached, tables._sin_cached
    else:
        modules = [None, None]
        cos, sin = rotary_tables(_S + _MAX_OFFSET, _ROTARY_DIM, device)

    eager = _forward_backward(_rotary_forward(entry, cos, sin, modules[0]), x, weight, offsets,
                              grad)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend(backend)
    compiled_forward = torch.compile(_rotary_forward(entry, cos, sin, modules[1]),
                                     backend=counter, fullgraph=fullgraph)
    compiled = _forward_backward(compiled_forward, x, weight, offsets, grad)
    ref = _forward_backward(_rotary_forward_ref(entry, cos, sin), x, weight, offsets, grad)
    assert counter.frame_count == 1  # one graph: no break, nothing fell back to eager
    for name, ours_compiled, ours_eager, expected in zip(("out", "dx", "dweight"), compiled,
                                                         eager, ref):
        torch.testing.assert_close(ours_compiled, ours_eager, msg=f"{name}: compiled vs eager")
        torch.testing.assert_close(ours_eager, expected, rtol=1e-5, atol=1e-5,
                                   msg=f"{name}: eager vs reference")


@pytest.mark.parametrize("offsets_kind", ["int", "tensor"])
@pytest.mark.parametrize("entry", list(_ENTRY_HEADS))
def test_inplace_rotary_compiled_fullgraph(entry, offsets_kind):
    # aot_eager: Dynamo and AOTAutograd (functionalisation, the joint graph), where in-place
    # rotary used to fail; no code generation, which keeps the CPU run short.
    _check_compiled_rotary(entry, offsets_kind, "aot_eager", fullgraph=True, device=DEVICE)


@pytest.mark.parametrize("entry, offsets_kind", [("qkv_", "tensor"), ("inplace", "int")])
def test_inplace_rotary_compiled_inductor(entry, offsets_kind):
    # Inductor adds its re-inplacing of the functionalised op.
    _check_compiled_rotary(entry, offsets_kind, "inductor", fullgraph=False, device=DEVICE)


@pytest.mark.gpu
@pytest.mark.parametrize("entry", list(_ENTRY_HEADS))
def test_inplace_rotary_compiled_inductor_gpu(entry):
    _check_compiled_rotary(entry, "tensor", "inductor", fullgraph=True, device="cuda")
