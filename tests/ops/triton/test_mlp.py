"""FusedDenseSqreluDense (fc1 -> squared ReLU -> fc2 on the Triton GEMMs) against the same MLP in
plain PyTorch: output and every gradient, each checkpoint level, with and without biases. Small
shapes on CPU (the Triton interpreter), larger ones on the GPU.

Error rule (DESIGN.md): our error against the float64 reference is at most twice the error of the
same reference computed in the input dtype, plus a small absolute slack.
"""

import pytest
import torch

from flash_attn.ops.triton.mlp import (
    FusedDenseSqreluDense,
    fused_dense_sqrelu_dense_function,
    fused_dense_sqrelu_dense_ref,
)
from flash_attn.utils.testing import triton_interpreter_slack

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (batch shape, in_features, hidden_features, out_features)
SHAPES = [((3, 11), 40, 72, 24)]
if DEVICE == "cuda":
    SHAPES += [((4, 512), 1024, 4096, 1024)]


def _assert_within_rule(name, ours, ref, ref_lowp):
    assert not ours.isnan().any(), f"{name} has NaN"
    err = (ours.double() - ref).abs().max().item()
    err_lowp = (ref_lowp.double() - ref).abs().max().item()
    # Weight gradients sum over every row: fp32 differs by accumulation order alone.
    slack = 1e-5 * ref.abs().max().item() + 1e-6 + triton_interpreter_slack(ours.dtype, ref)
    assert err <= 2 * err_lowp + slack, f"{name}: error {err:.3g} vs in-dtype {err_lowp:.3g}"


def _module(in_features, hidden, out_features, dtype, bias=True, checkpoint_lvl=0, seed=0):
    torch.manual_seed(seed)
    mlp = FusedDenseSqreluDense(in_features, hidden, out_features, bias1=bias, bias2=bias,
                                checkpoint_lvl=checkpoint_lvl, device=DEVICE, dtype=dtype)
    with torch.no_grad():  # biases large enough that the squared ReLU cuts a real share
        for p in mlp.parameters():
            if p.dim() == 1:
                p.normal_()
    return mlp


def _run(fn, x, params, grad_output, dtype=None):
    """[fn(x, *params), the gradients of x and of the params that are not None], with every
    input cast to dtype (when given)."""
    def leaf(t):
        return None if t is None else (t.to(dtype) if dtype else t).detach().requires_grad_()

    leaves = [leaf(t) for t in [x] + params]
    out = fn(*leaves)
    out.backward(grad_output.to(dtype) if dtype else grad_output)
    return [out.detach()] + [t.grad for t in leaves if t is not None]


def _grid():
    """dtype x checkpoint_lvl x bias x SHAPES. The GPU's large shape autotunes and compiles its
    kernels per case: beyond checkpoint_lvl 0 with biases it is a slow sweep there."""
    for i, shape in enumerate(SHAPES):
        for dtype in DTYPES:
            for checkpoint_lvl in (0, 1, 2):
                for bias in (True, False):
                    slow = i > 0 and (checkpoint_lvl, bias) != (0, True)
                    yield pytest.param(dtype, checkpoint_lvl, bias, *shape,
                                       marks=[pytest.mark.slow] if slow else [])


@pytest.mark.parametrize("dtype, checkpoint_lvl, bias, batch_shape, d_in, hidden, d_out",
                         list(_grid()))
def test_forward_backward_match_reference(dtype, checkpoint_lvl, bias, batch_shape, d_in, hidden,
                                          d_out):
    mlp = _module(d_in, hidden, d_out, dtype, bias, checkpoint_lvl)
    torch.manual_seed(1)
    x = torch.randn(*batch_shape, d_in, device=DEVICE, dtype=dtype)
    grad_output = torch.randn(*batch_shape, d_out, device=DEVICE, dtype=dtype)
    params = [mlp.fc1.weight, mlp.fc1.bias, mlp.fc2.weight, mlp.fc2.bias]
    names = ["out", "x.grad"] + [f"{n}.grad" for n, p in zip(
        ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"], params) if p is not None]

    def ours(x, w1, b1, w2, b2):
        return fused_dense_sqrelu_dense_function(x, w1, b1, w2, b2, checkpoint_lvl)

    got = _run(ours, x, params, grad_output)
    ref = _run(fused_dense_sqrelu_dense_ref, x, params, grad_output, dtype=torch.float64)
    lowp = _run(fused_dense_sqrelu_dense_ref, x, params, grad_output)
    assert len(got) == len(names)
    for name, a, b, c in zip(names, got, ref, lowp):
        assert a.shape == b.shape and a.dtype == dtype, name
        _assert_within_rule(name, a, b, c)


def test_checkpoint_level_2_recomputes_the_same_values():
    """Level 2 recomputes fc1 with the same kernel: gradients bit for bit those of level 0."""
    grads = {}
    for lvl in (0, 2):
        mlp = _module(40, 72, 24, torch.float16, checkpoint_lvl=lvl)
        torch.manual_seed(1)
        x = torch.randn(3, 11, 40, device=DEVICE, dtype=torch.float16, requires_grad=True)
        mlp(x).backward(torch.randn(3, 11, 24, device=DEVICE, dtype=torch.float16))
        grads[lvl] = [x.grad] + [p.grad for p in mlp.parameters()]
    for a, b in zip(grads[0], grads[2]):
        assert torch.equal(a, b)


def test_module_defaults_and_input_grad_only():
    mlp = FusedDenseSqreluDense(16, device=DEVICE)
    assert (mlp.fc1.in_features, mlp.fc1.out_features, mlp.fc2.out_features) == (16, 64, 16)
    mlp.requires_grad_(False)
    x = torch.randn(5, 16, device=DEVICE, requires_grad=True)
    mlp(x).sum().backward()
    assert x.grad is not None and all(p.grad is None for p in mlp.parameters())


def test_bad_input_is_named():
    with pytest.raises(ValueError, match=r"checkpoint_lvl must be one of \(0, 1, 2\)"):
        FusedDenseSqreluDense(8, checkpoint_lvl=3)
    mlp = FusedDenseSqreluDense(8, 16, 4, device=DEVICE)
    w1, b1, w2, b2 = mlp.fc1.weight, mlp.fc1.bias, mlp.fc2.weight, mlp.fc2.bias
    x = torch.randn(2, 8, device=DEVICE)
    cases = [
        ((x.half(), w1, b1, w2, b2), r"weight1 must be torch.float16 on .* like x"),
        ((torch.randn(2, 7, device=DEVICE), w1, b1, w2, b2), r"weight1 must be of shape \(16, 7\)"),
        ((x, w1, b1[:3], w2, b2), r"bias1 must be of shape \(16,\)"),
        ((x, w1, b1, w2[:, :8], b2), r"weight2 must be of shape \(4, 16\)"),
        ((x, w1, b1, w2, b2.double()), r"bias2 must be torch.float32"),
        ((x, w1, b1, w2, b2[:2]), r"bias2 must be of shape \(4,\)"),
        ((x.long(), w1, b1, w2, b2), r"x must be a float16"),
        ((x, w1, b1, w2, b2, 5), r"checkpoint_lvl must be one of"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            fused_dense_sqrelu_dense_function(*args)


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="the kernels were built for the GPU: Triton picks the interpreter "
                           "when they are defined")
def test_cpu_tensor_without_interpreter_names_op(monkeypatch):
    mlp = FusedDenseSqreluDense(8)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match=r"^triton_linear_act: x is a CPU tensor"):
        mlp(torch.randn(2, 8))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_autocast_gpu(dtype):
    mlp = _module(256, 1024, 256, torch.float32)
    x = torch.randn(8, 128, 256, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=dtype):
        out = mlp(x)
    assert out.dtype == dtype
    out.float().sum().backward()
    assert x.grad.dtype == torch.float32 and mlp.fc1.weight.grad.dtype == torch.float32
    params = [p.detach().to(dtype) for p in mlp.parameters()]
    ref = fused_dense_sqrelu_dense_ref(x.detach().double(), *[p.double() for p in params])
    lowp = fused_dense_sqrelu_dense_ref(x.detach().to(dtype), *params)
    _assert_within_rule("out", out.detach(), ref, lowp)
