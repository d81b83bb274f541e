from functools import partial

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from flash_attn.modules.block import Block, DropPath, ParallelBlock
from flash_attn.modules.mha import MHA, import_optional
from flash_attn.modules.mlp import Mlp

DIM = 32


def _mixer(dim):
    return MHA(dim, 4, causal=True)


def _mlp(dim):
    return Mlp(dim, hidden_features=48)


def test_prenorm_block_matches_manual():
    torch.manual_seed(0)
    block = Block(DIM, _mixer, _mlp, prenorm=True).eval()
    x, res = torch.randn(2, 5, DIM), torch.randn(2, 5, DIM)
    hidden, residual = block(x, res)
    r1 = x + res
    r2 = block.mixer(block.norm1(r1)) + r1
    assert torch.allclose(residual, r2, atol=1e-6)
    assert torch.allclose(hidden, block.mlp(block.norm2(r2)), atol=1e-6)
    # First block: no residual yet, the input itself is the residual stream.
    hidden, residual = block(x)
    assert torch.allclose(residual, block.mixer(block.norm1(x)) + x, atol=1e-6)


def test_postnorm_block_matches_manual():
    torch.manual_seed(0)
    block = Block(DIM, _mixer, _mlp, prenorm=False).eval()
    x = torch.randn(2, 5, DIM)
    h = block.norm1(block.mixer(x) + x)
    assert torch.allclose(block(x), block.norm2(block.mlp(h) + h), atol=1e-6)
    resid = Block(DIM, partial(MHA, num_heads=4, causal=True, return_residual=True),
                  partial(Mlp, hidden_features=48, return_residual=True), prenorm=False, return_residual=True).eval()
    resid.load_state_dict(block.state_dict())
    assert torch.allclose(resid(x), block(x), atol=1e-6)


def test_prenorm_block_mixer_subset():
    torch.manual_seed(0)
    block = Block(DIM, partial(MHA, num_heads=4, cross_attn=True), _mlp).eval()
    x, res = torch.randn(2, 6, DIM), torch.randn(2, 6, DIM)
    full_h, full_r = block(x, res)
    h, r = block(x, res, mixer_subset=slice(0, 1))
    assert torch.allclose(h, full_h[:, :1], atol=1e-6) and torch.allclose(r, full_r[:, :1], atol=1e-6)


def test_residual_in_fp32():
    block = Block(DIM, _mixer, _mlp, residual_in_fp32=True).to(torch.bfloat16)
    hidden, residual = block(torch.randn(2, 3, DIM, dtype=torch.bfloat16))
    assert residual.dtype == torch.float32 and hidden.dtype == torch.bfloat16


@pytest.mark.parametrize("tied_norm", [False, True])
def test_parallel_block_matches_manual(tied_norm):
    torch.manual_seed(0)
    block = ParallelBlock(DIM, _mixer, _mlp, tied_norm=tied_norm).eval()
    h1, h2, res = torch.randn(3, 2, 5, DIM).unbind(0)
    out1, out2, residual = block(h1, h2, res)
    r = h1 + h2 + res
    norm2 = block.norm1 if tied_norm else block.norm2
    assert torch.allclose(residual, r, atol=1e-6)
    assert torch.allclose(out1, block.mixer(block.norm1(r)), atol=1e-6)
    assert torch.allclose(out2, block.mlp(norm2(r)), atol=1e-6)


def test_drop_path_drops_whole_samples():
    torch.manual_seed(0)
    drop = DropPath(0.5)
    x = torch.ones(1000, 3, 4)
    y = drop(x)
    per_sample = y.flatten(1)
    assert set(per_sample.unique().tolist()) <= {0.0, 2.0}
    assert (per_sample.min(1).values == per_sample.max(1).values).all()  # all or nothing
    assert 0.4 < (per_sample[:, 0] > 0).float().mean().item() < 0.6
    assert torch.equal(drop.eval()(x), x)


def _fused_available():
    return import_optional("flash_attn.ops.triton.layer_norm", "layer_norm_fn") is not None


@pytest.mark.parametrize("prenorm", [True, False])
@pytest.mark.parametrize("norm_cls", [nn.LayerNorm, nn.RMSNorm])
def test_fused_dropout_add_ln_matches_plain(prenorm, norm_cls):
    """Runs the Triton kernel through Block's fused path, in fp32: on the GPU when there is one
    (where the conftest leaves the interpreter off, so CPU tensors would not run), else in the
    interpreter on CPU."""
    if not _fused_available():
        pytest.skip("flash_attn.ops.triton.layer_norm is not available")
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    norm = partial(norm_cls, eps=1e-5)
    plain = Block(DIM, _mixer, _mlp, norm_cls=norm, prenorm=prenorm).to(device).eval()
    fused = Block(DIM, _mixer, _mlp, norm_cls=norm, prenorm=prenorm,
                  fused_dropout_add_ln=True).to(device).eval()
    assert fused.fused_dropout_add_ln
    fused.load_state_dict(plain.state_dict())
    x, res = torch.randn(2, 5, DIM, device=device), torch.randn(2, 5, DIM, device=device)
    if prenorm:
        (h_p, r_p), (h_f, r_f) = plain(x, res), fused(x, res)
        assert (r_p - r_f).abs().max().item() < 1e-5
    else:
        h_p, h_f = plain(x), fused(x)
    assert (h_p - h_f).abs().max().item() < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("prenorm", [True, False])
def test_fused_dropout_add_ln_gpu(prenorm):
    if not _fused_available():
        pytest.skip("flash_attn.ops.triton.layer_norm is not available")
    torch.manual_seed(0)
    kwargs = dict(prenorm=prenorm)
    mixer = partial(MHA, num_heads=8, causal=True, device="cuda", dtype=torch.bfloat16)
    mlp = partial(Mlp, device="cuda", dtype=torch.bfloat16)
    norm = partial(nn.LayerNorm, device="cuda", dtype=torch.bfloat16)
    plain = Block(512, mixer, mlp, norm_cls=norm, **kwargs).eval()
    fused = Block(512, mixer, mlp, norm_cls=norm, fused_dropout_add_ln=True, **kwargs).eval()
    fused.load_state_dict(plain.state_dict())
    x = torch.randn(4, 128, 512, device="cuda", dtype=torch.bfloat16)
    out_p, out_f = plain(x), fused(x)
    if prenorm:
        out_p, out_f = out_p[0], out_f[0]
    assert (out_p.float() - out_f.float()).abs().max().item() < 5e-2
    assert F.mse_loss(out_p.float(), out_f.float()).item() < 1e-4
