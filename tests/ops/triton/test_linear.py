"""triton_linear_act / triton_dgrad_act (and the activations of k_activations in their
epilogues) against float64 PyTorch references: small shapes on CPU (the Triton interpreter),
larger ones on the GPU.

Error rule (DESIGN.md): our error against the float64 reference is at most twice the error of the
same reference computed in the input dtype, plus a small absolute slack.
"""

import pytest
import torch

from flash_attn.ops.triton.k_activations import (
    Activation,
    activation_grad_ref,
    activation_ref,
    get_triton_activation_bwd_kernel,
    get_triton_activation_kernel,
    gelu_approx_grad,
    squared_relu,
)
from flash_attn.ops.triton.linear import (
    ACTIVATIONS,
    _launch,
    dgrad_act_ref,
    linear_act_ref,
    triton_dgrad_act,
    triton_linear_act,
)
from flash_attn.utils.testing import triton_interpreter_slack

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (batch shape, K, N): K and N not multiples of the tiles, K a multiple of BLOCK_K (EVEN_K), one
# row. GPU_SHAPES: large enough to be autotuned, for a few activations (each new shape and dtype
# tunes several tile configs).
SHAPES = [((97,), 70, 113), ((3, 11), 64, 40), ((1,), 33, 7)]
GPU_SHAPES = [((4, 1000), 1024, 1030)]


def _assert_within_rule(name, ours, ref, ref_lowp):
    assert not ours.isnan().any(), f"{name} has NaN"
    err = (ours.double() - ref).abs().max().item()
    err_lowp = (ref_lowp.double() - ref).abs().max().item()
    scale = ref.abs().max().item()
    slack = 1e-6 * scale + 1e-6 + triton_interpreter_slack(ours.dtype, ref)
    assert err <= 2 * err_lowp + slack, f"{name}: error {err:.3g} vs in-dtype {err_lowp:.3g}"


def _inputs(batch_shape, K, N, dtype, seed=0):
    torch.manual_seed(seed)
    x = torch.randn(*batch_shape, K, device=DEVICE, dtype=dtype)
    weight = (torch.randn(N, K, device=DEVICE) * K ** -0.5).to(dtype)
    bias = torch.randn(N, device=DEVICE, dtype=dtype)
    return x, weight, bias


# ----------------------------------------------------------------------------------------------
# The activations.
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_activation_grad_ref_is_the_derivative(activation):
    x = torch.linspace(-6, 6, 241, dtype=torch.float64)
    x = torch.cat([x, torch.zeros(1, dtype=x.dtype)]).requires_grad_()  # 0 itself: the kink
    (grad,) = torch.autograd.grad(activation_ref(x, activation).sum(), x)
    torch.testing.assert_close(activation_grad_ref(x.detach(), activation), grad, rtol=1e-12,
                               atol=1e-12)


# exp overflowing to inf in the tails is intended (it saturates to the right limit).
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_device_functions_through_an_identity_gemm(activation):
    """x @ I is exact, so the epilogues show the activation and its derivative alone."""
    torch.manual_seed(0)
    x = torch.randn(48, 64, device=DEVICE) * 4
    x[0, :8] = 0.0  # the kink
    x[1, :4] = torch.tensor([30.0, -30.0, 100.0, -100.0])  # the tails (no NaN from exp)
    eye = torch.eye(64, device=DEVICE)
    out = triton_linear_act(x, eye, activation=activation)
    ref = activation_ref(x.double(), activation)
    torch.testing.assert_close(out.double(), ref, rtol=2e-6, atol=2e-6)
    g = torch.randn(48, 64, device=DEVICE)
    grad = triton_dgrad_act(g, eye, activation, act_input=x)
    expected = g.double() * activation_grad_ref(x.double(), activation)
    torch.testing.assert_close(grad.double(), expected, rtol=2e-6, atol=2e-6)


def test_activation_lookup():
    assert get_triton_activation_kernel(Activation.SquaredReLU) is squared_relu
    assert get_triton_activation_bwd_kernel("gelu_approx") is gelu_approx_grad
    assert get_triton_activation_kernel(None) is None
    assert set(ACTIVATIONS) == {"id", "relu", "leaky_relu", "gelu", "gelu_approx", "squared_relu"}


# ----------------------------------------------------------------------------------------------
# The GEMMs against the references.
# ----------------------------------------------------------------------------------------------


def _check_linear_act_and_dgrad(dtype, activation, batch_shape, K, N):
    x, weight, bias = _inputs(batch_shape, K, N, dtype)
    out, act_input = triton_linear_act(x, weight, bias, activation, save_act_input=True)
    assert out.shape == act_input.shape == (*batch_shape, N) and out.dtype == dtype
    ref, ref_act_input = linear_act_ref(x.double(), weight.double(), bias.double(), activation,
                                        save_act_input=True)
    lowp, lowp_act_input = linear_act_ref(x, weight, bias, activation, save_act_input=True)
    _assert_within_rule("act_input", act_input, ref_act_input, lowp_act_input)
    _assert_within_rule("out", out, ref, lowp)
    assert torch.equal(triton_linear_act(x, weight, bias, activation), out)

    # The backward of the next layer (weight2 (P, N)) into this activation.
    torch.manual_seed(1)
    P = 37
    grad_output = torch.randn(*batch_shape, P, device=DEVICE, dtype=dtype)
    weight2 = (torch.randn(P, N, device=DEVICE) * P ** -0.5).to(dtype)
    grad = triton_dgrad_act(grad_output, weight2, activation, act_input)
    assert grad.shape == (*batch_shape, N) and grad.dtype == dtype
    ref = dgrad_act_ref(grad_output.double(), weight2.double(), activation, act_input.double())
    lowp = dgrad_act_ref(grad_output, weight2, activation, act_input)
    _assert_within_rule("grad", grad, ref, lowp)


def _grid():
    """dtype x activation x SHAPES. On the GPU every case compiles its own kernels (seconds each),
    so beyond the first shape the grid is a slow sweep there (--run-slow); the interpreter runs it
    all."""
    for i, shape in enumerate(SHAPES):
        marks = [pytest.mark.slow] if DEVICE == "cuda" and i > 0 else []
        for dtype in DTYPES:
            for activation in ACTIVATIONS:
                yield pytest.param(dtype, activation, *shape, marks=marks)


@pytest.mark.parametrize("dtype, activation, batch_shape, K, N", list(_grid()))
def test_linear_act_and_dgrad_match_reference(dtype, activation, batch_shape, K, N):
    _check_linear_act_and_dgrad(dtype, activation, batch_shape, K, N)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["id", "squared_relu", "gelu_approx"])
@pytest.mark.parametrize("batch_shape, K, N", GPU_SHAPES)
def test_linear_act_and_dgrad_large_gpu(dtype, activation, batch_shape, K, N):
    _check_linear_act_and_dgrad(dtype, activation, batch_shape, K, N)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_without_bias_and_with_strided_operands(dtype):
    torch.manual_seed(0)
    x_big = torch.randn(40, 2 * 70, device=DEVICE, dtype=dtype)
    x = x_big[:, ::2]  # column stride 2
    weight = (torch.randn(70, 50, device=DEVICE) * 70 ** -0.5).to(dtype).t()  # (50, 70), K-major
    out = triton_linear_act(x, weight, None, "gelu_approx")
    ref = linear_act_ref(x.double(), weight.double(), None, "gelu_approx")
    _assert_within_rule("out", out, ref, linear_act_ref(x, weight, None, "gelu_approx"))
    grad_output = torch.randn(50, 40, device=DEVICE, dtype=dtype).t()  # (40, 50) column-major
    act_input = torch.randn(70, 40, device=DEVICE, dtype=dtype).t()
    grad = triton_dgrad_act(grad_output, weight, "relu", act_input)  # weight (50, 70) strided
    _assert_within_rule("grad", grad, dgrad_act_ref(grad_output.double(), weight.double(),
                                                    "relu", act_input.double()),
                        dgrad_act_ref(grad_output, weight, "relu", act_input))


def test_every_output_element_is_written():
    torch.manual_seed(0)
    a = torch.randn(45, 33, device=DEVICE)
    w = torch.randn(71, 33, device=DEVICE)
    out = torch.full((45, 71), float("nan"), device=DEVICE)
    act_input = torch.full((45, 71), float("nan"), device=DEVICE)
    _launch(out, act_input, a, w, None, w.stride(1), w.stride(0), "relu", True, False, "test", "a")
    assert not out.isnan().any() and not act_input.isnan().any()


def test_empty_rows():
    x = torch.randn(0, 16, device=DEVICE)
    out, act_input = triton_linear_act(x, torch.randn(8, 16, device=DEVICE), None, "gelu", True)
    assert out.shape == act_input.shape == (0, 8)


# ----------------------------------------------------------------------------------------------
# Bad input: the error names the argument and what was expected.
# ----------------------------------------------------------------------------------------------


def test_bad_input_is_named():
    x, weight, bias = _inputs((4,), 16, 8, torch.float32)
    cases = [
        (lambda: triton_linear_act(x, weight, bias, "swish"), r"activation must be one of"),
        (lambda: triton_linear_act(x.long(), weight, bias), r"x must be a float16"),
        (lambda: triton_linear_act(x[0, 0], weight, bias), r"x must be at least 1-D"),
        (lambda: triton_linear_act(x, weight[0], bias), r"weight must be 2-D"),
        (lambda: triton_linear_act(x, weight.half(), bias), r"weight must be torch.float32"),
        (lambda: triton_linear_act(x, weight[:, :8], bias), r"weight must be \(N, 16\)"),
        (lambda: triton_linear_act(x, weight, bias[:4]), r"bias must be of shape \(8,\)"),
        (lambda: triton_linear_act(x, weight, bias.double()), r"bias must be a float16"),
        (lambda: triton_dgrad_act(x, weight.t(), "gelu"), r"act_input must be given"),
        (lambda: triton_dgrad_act(x, weight.t(), "gelu", torch.randn(4, 7, device=DEVICE)),
         r"act_input must be of shape \(4, 8\)"),
        (lambda: triton_dgrad_act(x, weight, "id"), r"weight must be \(16, K\)"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="the kernels were built for the GPU: Triton picks the interpreter "
                           "when they are defined")
def test_cpu_tensor_without_interpreter_names_op(monkeypatch):
    x, weight, bias = _inputs((4,), 16, 8, torch.float32)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match=r"^triton_linear_act: x is a CPU tensor"):
        triton_linear_act(x, weight, bias, "gelu")
    with pytest.raises(RuntimeError, match=r"^triton_dgrad_act: grad_output is a CPU tensor"):
        triton_dgrad_act(x, weight.t())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_tf32_follows_torch_setting_gpu(monkeypatch):
    x, weight, bias = _inputs((512,), 1024, 512, torch.float32)
    ref = linear_act_ref(x.double(), weight.double(), bias.double())
    exact = (triton_linear_act(x, weight, bias).double() - ref).abs().max().item()
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", True)
    tf32 = (triton_linear_act(x, weight, bias).double() - ref).abs().max().item()
    assert exact < 1e-4 < tf32  # TF32 keeps 10 mantissa bits: errors ~1e-3 at K = 1024
