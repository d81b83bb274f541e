"""apply_rotary (Triton) against the plain-PyTorch apply_rotary_ref: small shapes on CPU (the
Triton interpreter), the full grid on the GPU."""

import pytest
import torch

from flash_attn.ops.triton.rotary import apply_rotary, apply_rotary_ref
from flash_attn.utils.testing import rotary_tables, triton_interpreter_slack

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _assert_within_dtype_error(out, x, cos, sin, **kwargs):
    """Our error against the fp32 reference is at most twice the error of the same reference
    computed in x's dtype, plus a small absolute slack."""
    ref = apply_rotary_ref(x.float(), cos.float(), sin.float(), **kwargs)
    ref_lowp = apply_rotary_ref(x, cos, sin, **kwargs)
    assert not out.isnan().any()
    err = (out.float() - ref).abs().max().item()
    err_lowp = (ref_lowp.float() - ref).abs().max().item()
    assert err <= 2 * err_lowp + 1e-5 + triton_interpreter_slack(x.dtype, ref), (err, err_lowp)


def _offsets(kind, batch, device):
    if kind == "int":
        return 3
    if kind == "tensor":
        return torch.randint(0, 6, (batch,), dtype=torch.int32, device=device)
    return 0


def _check_apply_rotary(dtype, interleaved, rotary_dim, headdim, offsets_kind, inplace, batch,
                        seqlen, nheads, device):
    torch.manual_seed(0)
    x = torch.randn(batch, seqlen, nheads, headdim, device=device, dtype=dtype)
    cos, sin = rotary_tables(seqlen + 8, rotary_dim, device, dtype)
    offsets = _offsets(offsets_kind, batch, device)
    x_in = x.clone()
    out = apply_rotary(x_in, cos, sin, seqlen_offsets=offsets, interleaved=interleaved,
                       inplace=inplace)
    if inplace:
        assert out.data_ptr() == x_in.data_ptr()
    else:
        assert torch.equal(x_in, x)
    _assert_within_dtype_error(out, x, cos, sin, seqlen_offsets=offsets, interleaved=interleaved)
    # Features past rotary_dim pass through bit for bit.
    assert torch.equal(out[..., rotary_dim:], x[..., rotary_dim:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim", [40, 24, 10])
@pytest.mark.parametrize("offsets_kind", ["zero", "int", "tensor"])
@pytest.mark.parametrize("inplace", [False, True])
def test_apply_rotary_small(dtype, interleaved, rotary_dim, offsets_kind, inplace):
    _check_apply_rotary(dtype, interleaved, rotary_dim, 40, offsets_kind, inplace, batch=2,
                        seqlen=13, nheads=3, device=DEVICE)


@pytest.mark.parametrize("interleaved", [False, True])
def test_apply_rotary_matches_complex_multiplication(interleaved):
    # Independent of apply_rotary_ref: the rotation is multiplication by exp(i * angle).
    torch.manual_seed(0)
    b, s, h, d = 2, 5, 2, 8
    x = torch.randn(b, s, h, d, device=DEVICE)
    angle = torch.randn(s, d // 2, device=DEVICE)
    out = apply_rotary(x, angle.cos(), angle.sin(), interleaved=interleaved)
    if interleaved:
        pairs = x.view(b, s, h, d // 2, 2)
        re, im = pairs[..., 0], pairs[..., 1]
    else:
        re, im = x[..., : d // 2], x[..., d // 2:]
    z = torch.complex(re, im) * torch.polar(torch.ones_like(angle), angle)[:, None, :]
    expected = (torch.stack((z.real, z.imag), -1).flatten(-2) if interleaved
                else torch.cat((z.real, z.imag), -1))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("interleaved", [False, True])
def test_conjugate_inverts(interleaved):
    torch.manual_seed(0)
    x = torch.randn(2, 7, 3, 16, device=DEVICE)
    cos, sin = rotary_tables(9, 12, DEVICE)
    y = apply_rotary(x, cos, sin, seqlen_offsets=2, interleaved=interleaved)
    back = apply_rotary(y, cos, sin, seqlen_offsets=2, interleaved=interleaved, conjugate=True)
    torch.testing.assert_close(back, x, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(y[..., :12], x[..., :12])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("offsets_kind", ["zero", "tensor"])
def test_apply_rotary_varlen(dtype, interleaved, offsets_kind):
    torch.manual_seed(0)
    lengths = [5, 0, 11, 3]
    cu_seqlens = torch.tensor([0] + lengths, device=DEVICE).cumsum(0).to(torch.int32)
    x = torch.randn(sum(lengths), 3, 24, device=DEVICE, dtype=dtype)
    cos, sin = rotary_tables(16, 16, DEVICE, dtype)
    offsets = _offsets(offsets_kind, len(lengths), DEVICE)
    out = apply_rotary(x, cos, sin, seqlen_offsets=offsets, cu_seqlens=cu_seqlens,
                       max_seqlen=max(lengths), interleaved=interleaved)
    _assert_within_dtype_error(out, x, cos, sin, seqlen_offsets=offsets, cu_seqlens=cu_seqlens,
                               max_seqlen=max(lengths), interleaved=interleaved)


def test_varlen_matches_padded_batch():
    torch.manual_seed(0)
    lengths = [4, 9]
    x = torch.randn(2, 9, 2, 16, device=DEVICE)
    packed = torch.cat([x[0, :4], x[1, :9]])
    cu_seqlens = torch.tensor([0, 4, 13], dtype=torch.int32, device=DEVICE)
    cos, sin = rotary_tables(12, 16, DEVICE)
    offsets = torch.tensor([2, 3], device=DEVICE)
    padded = apply_rotary(x, cos, sin, seqlen_offsets=offsets)
    varlen = apply_rotary(packed, cos, sin, seqlen_offsets=offsets, cu_seqlens=cu_seqlens,
                          max_seqlen=max(lengths))
    torch.testing.assert_close(varlen, torch.cat([padded[0, :4], padded[1, :9]]), rtol=0, atol=0)


def test_every_output_element_is_written():
    torch.manual_seed(0)
    x = torch.randn(2, 11, 5, 40, device=DEVICE)
    cos, sin = rotary_tables(11, 24, DEVICE)
    out = torch.full_like(x, float("nan"))
    apply_rotary(x, cos, sin, out=out)
    assert not out.isnan().any()


def test_positions_past_the_table_are_not_rotated():
    # flash-attn's rule: a position without a cos/sin row rotates by 0.
    x = torch.randn(2, 4, 1, 8, device=DEVICE)
    cos, sin = rotary_tables(6, 8, DEVICE)
    out = apply_rotary(x, cos, sin, seqlen_offsets=torch.tensor([0, 4], device=DEVICE))
    torch.testing.assert_close(out[1, 2:], x[1, 2:], rtol=0, atol=0)
    assert not torch.allclose(out[1, :2], x[1, :2])


def test_strided_input_and_output():
    # q and k of a packed qkv (b, s, 3, h, d) are strided views: rotate them where they lie.
    torch.manual_seed(0)
    qkv = torch.randn(2, 6, 3, 4, 16, device=DEVICE)
    cos, sin = rotary_tables(6, 16, DEVICE)
    k = qkv[:, :, 1]
    expected = apply_rotary_ref(k, cos, sin)
    out = apply_rotary(k, cos, sin)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    before = qkv.clone()
    apply_rotary(k, cos, sin, inplace=True)
    torch.testing.assert_close(qkv[:, :, 1], expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(qkv[:, :, [0, 2]], before[:, :, [0, 2]])


@pytest.mark.parametrize("bad, match", [
    (dict(x=torch.randn(2, 3, 4)), "x must be 4-D"),
    (dict(x=torch.randn(2, 3, 4, 8, dtype=torch.float64)), "x must be a float16"),
    (dict(cos=torch.randn(8, 6), sin=torch.randn(8, 6)), "rotary_dim <= headdim"),
    (dict(cos=torch.randn(2, 4), sin=torch.randn(2, 4)), "cos must be at least seqlen"),
    (dict(sin=torch.randn(8, 3)), "sin must be the shape and dtype of cos"),
    (dict(seqlen_offsets=torch.zeros(3, dtype=torch.int32)), "seqlen_offsets must be"),
    (dict(seqlen_offsets=6), "seqlen_offsets must be at most"),
    (dict(x=torch.randn(6, 4, 8), cu_seqlens=torch.tensor([0.0, 6.0]), max_seqlen=6),
     "cu_seqlens must be a 1-D int32"),
    (dict(x=torch.randn(6, 4, 8), cu_seqlens=torch.tensor([0, 6], dtype=torch.int32)),
     "max_seqlen must be an int"),
])
def test_bad_arguments_are_named(bad, match):
    args = dict(x=torch.randn(2, 3, 4, 8), cos=torch.randn(8, 4), sin=torch.randn(8, 4))
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        apply_rotary(**args)


def _op_args(op_name, offsets_kind, varlen, device):
    """Arguments of the flash_attn::_apply_rotary* op op_name, in its schema's order."""
    torch.manual_seed(0)
    cos, sin = rotary_tables(9, 6, device)
    if varlen:
        x = torch.randn(7, 3, 8, device=device)
        layout = (torch.tensor([0, 3, 7], dtype=torch.int32, device=device), 4)
    else:
        x = torch.randn(2, 5, 3, 8, device=device)
        layout = (None, None)
    offsets = ((torch.tensor([1, 3], dtype=torch.int32, device=device), 0)
               if offsets_kind == "tensor" else (None, 2))
    tensors = (x, cos, sin)
    if op_name == "_apply_rotary_out":
        tensors += (torch.empty_like(x),)
    return tensors + offsets + layout + (True, False)  # interleaved, conjugate


@pytest.mark.parametrize("op_name, offsets_kind, varlen", [
    ("_apply_rotary", "int", False), ("_apply_rotary", "tensor", True),
    ("_apply_rotary_inplace", "tensor", False), ("_apply_rotary_out", "int", True),
])
def test_ops_pass_opcheck(op_name, offsets_kind, varlen):
    # What torch.compile relies on: the schema declares exactly the writes the kernel makes, and
    # the fake implementation gives the real outputs' metadata (static and dynamic shapes).
    op = getattr(torch.ops.flash_attn, op_name).default
    torch.library.opcheck(op, _op_args(op_name, offsets_kind, varlen, DEVICE))


def test_inplace_write_is_seen_by_autograd():
    # exp saves its output for the backward: rotating that output in place must not go unnoticed.
    x = torch.randn(1, 5, 2, 8, device=DEVICE, requires_grad=True)
    saved = x.exp()
    cos, sin = rotary_tables(5, 8, DEVICE)
    apply_rotary(saved, cos, sin, inplace=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        saved.sum().backward()


# Every distinct (dtype, layout, rotary_dim, headdim, ...) compiles its own kernel, so the default
# GPU run keeps a quick subset; --run-slow sweeps the full grid.
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("headdim, rotary_dim", [(128, 128), (111, 26)])
@pytest.mark.parametrize("offsets_kind", ["int", "tensor"])
@pytest.mark.parametrize("inplace", [False, True])
def test_apply_rotary_gpu(dtype, interleaved, headdim, rotary_dim, offsets_kind, inplace):
    _check_apply_rotary(dtype, interleaved, rotary_dim, headdim, offsets_kind, inplace, batch=4,
                        seqlen=217, nheads=5, device="cuda")


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_fraction", [1.0, 0.5, 0.25])
@pytest.mark.parametrize("headdim", [64, 128, 111, 256])
@pytest.mark.parametrize("seqlen", [217, 1024])
@pytest.mark.parametrize("offsets_kind", ["zero", "int", "tensor"])
@pytest.mark.parametrize("inplace", [False, True])
def test_apply_rotary_gpu_sweep(dtype, interleaved, rotary_fraction, headdim, seqlen,
                                offsets_kind, inplace):
    rotary_dim = int(rotary_fraction * headdim) // 2 * 2
    _check_apply_rotary(dtype, interleaved, rotary_dim, headdim, offsets_kind, inplace, batch=4,
                        seqlen=seqlen, nheads=5, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("offsets_kind", ["zero", "tensor"])
def test_apply_rotary_varlen_gpu(dtype, interleaved, offsets_kind):
    torch.manual_seed(0)
    lengths = [1, 513, 97, 1025, 0, 64]
    cu_seqlens = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
    x = torch.randn(sum(lengths), 8, 128, device="cuda", dtype=dtype)
    cos, sin = rotary_tables(2048, 64, "cuda", dtype)
    offsets = _offsets(offsets_kind, len(lengths), "cuda")
    out = torch.full_like(x, float("nan"))
    apply_rotary(x, cos, sin, seqlen_offsets=offsets, cu_seqlens=cu_seqlens,
                 max_seqlen=max(lengths), interleaved=interleaved, out=out)
    _assert_within_dtype_error(out, x, cos, sin, seqlen_offsets=offsets, cu_seqlens=cu_seqlens,
                               max_seqlen=max(lengths), interleaved=interleaved)
