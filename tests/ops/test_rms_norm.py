"""flash_attn.ops.rms_norm against a PyTorch RMSNorm, on the CUDA extension (GPU-marked) and on
the PyTorch statement of the extension's contract (CPU); see test_dropout_layer_norm.py."""

import importlib.util
from pathlib import Path

import pytest
import torch


def _load_sibling(name):
    # Test files are not a package (pytest --import-mode=importlib): load the sibling by path.
    spec = importlib.util.spec_from_file_location(f"_rms_norm_{name}",
                                                  Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_ln_tests = _load_sibling("test_dropout_layer_norm")
ln = _ln_tests.ln  # the fixture: wrappers on the real extension (GPU) or on the fake (CPU)
_assert_close = _ln_tests._assert_close


def rms_norm_reference(x, weight, eps, fp32):
    if fp32:
        x, weight = x.float(), weight.float()
    rstd = torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)
    return x * rstd * weight


def run_rms_norm(ln, shape, dtype, weight_dtype):
    torch.manual_seed(0)
    x = torch.randn(*shape, device=ln.device, dtype=dtype)
    weight = torch.randn(shape[-1], device=ln.device, dtype=weight_dtype)
    xs, ws = x.clone().requires_grad_(), weight.clone().requires_grad_()
    out = ln.rms.rms_norm(xs, ws, 1e-6)
    assert out.dtype == dtype and out.shape == x.shape
    refs = {}
    for fp32 in (True, False):
        # The fp32 reference has fp32 leaves, so that its gradients are not rounded to the
        # weight dtype: the rounding is what the low-precision reference's error measures.
        xr = x.detach().clone().to(torch.float32 if fp32 else dtype).requires_grad_()
        wr = weight.detach().clone().to(torch.float32 if fp32 else weight_dtype).requires_grad_()
        refs[fp32] = (xr, wr, rms_norm_reference(xr, wr, 1e-6, fp32))
    _assert_close("out", out, refs[True][2], refs[False][2])
    g = torch.randn_like(out)
    out.backward(g)
    for fp32 in (True, False):
        refs[fp32][2].backward(g.to(refs[fp32][2].dtype))
    _assert_close("grad x", xs.grad, refs[True][0].grad, refs[False][0].grad)
    _assert_close("grad weight", ws.grad, refs[True][1].grad, refs[False][1].grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rms_norm(ln, dtype):
    run_rms_norm(ln, (3, 7, 64), dtype, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("N", [8, 768, 2048, 2560, 4096, 8192])
@pytest.mark.parametrize("dtype,weight_dtype", [(torch.float32, torch.float32),
                                                (torch.float16, torch.float16),
                                                (torch.bfloat16, torch.bfloat16),
                                                (torch.bfloat16, torch.float32),
                                                (torch.float32, torch.float16)])
def test_rms_norm_gpu(N, dtype, weight_dtype):
    run_rms_norm(_ln_tests.types_ns("cuda"), (4, 513, N), dtype, weight_dtype)


def test_rms_norm_modules(ln):
    torch.manual_seed(0)
    norm = ln.rms.RMSNorm(48, eps=1e-5, device=ln.device)
    assert norm.bias is None and torch.all(norm.weight == 1)
    x = torch.randn(5, 48, device=ln.device)
    torch.testing.assert_close(norm(x), rms_norm_reference(x, norm.weight, 1e-5, True),
                               atol=1e-5, rtol=1e-5)

    block = ln.rms.DropoutAddRMSNorm(48, prenorm=True, p=0.3, eps=1e-5, device=ln.device)
    assert block.bias is None and block.epsilon == 1e-5
    res = torch.randn_like(x)
    block.eval()
    out, pre = block(x, res)
    torch.testing.assert_close(pre, x + res)
    torch.testing.assert_close(out, rms_norm_reference(x + res, block.weight, 1e-5, True),
                               atol=1e-5, rtol=1e-5)
    block.train()  # dropout now drops: the pre-norm sum differs from x + res somewhere
    _, pre_train = block(x, res)
    assert not torch.allclose(pre_train, x + res)


def test_dropout_add_rms_norm_with_bias(ln):
    _ln_tests.run_dropout_add_norm(ln, 23, 40, torch.float32, torch.float32, torch.float32, 0.2,
                                   is_rms_norm=True, has_bias=True, has_rowscale=True)


def test_dropout_add_rms_norm_subset_and_parallel(ln):
    _ln_tests.run_subset(ln, 6, 8, 32, torch.float32, True, True, 0.2, is_rms_norm=True)
    _ln_tests.run_parallel(ln, 17, 32, torch.float32, True, False, 0.2, True, is_rms_norm=True)
