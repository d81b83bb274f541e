"""flash_attn.ops.fused_dense and the fused_dense_lib extension.

CPU (CI): the plain fallback equals nn.Linear / F.gelu / F.relu bit for bit, and the autograd
plumbing of the fused paths (every checkpoint_lvl and heuristic, "auto") runs against a PyTorch
stand-in for fused_dense_lib in float64, where any plumbing mistake shows far above rounding.
GPU: the extension and the layers against an fp32 reference, within twice the error of PyTorch
computing the same thing in the input dtype.
"""

import collections
import functools
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import flash_attn.ops.fused_dense as fd
import flash_attn.ops.fused_dense_autotune as autotune
from flash_attn.ops.activations import gelu_bwd, sqrelu_fwd
from flash_attn.ops.fused_dense import FusedDense, FusedMLP, fused_dense_func, fused_mlp_func
from flash_attn.ops.triton.launch_device import triton_interpreter_enabled

ACTIVATIONS = ["gelu_approx", "relu", "sqrelu"]


def activation_fn(activation):
    if activation == "gelu_approx":
        return functools.partial(F.gelu, approximate="tanh")
    return F.relu if activation == "relu" else sqrelu_fwd


def plain_mlp(x, w1, b1, w2, b2, activation):
    return F.linear(activation_fn(activation)(F.linear(x, w1, b1)), w2, b2)


def leaf(t):
    return t.detach().clone().requires_grad_(t.requires_grad)


def run_with_grads(fn, tensors, grad_out):
    """fn(*leaf copies) and the gradients of (out * grad_out).sum() w.r.t. each copy."""
    tensors = [None if t is None else leaf(t) for t in tensors]
    out = fn(*tensors)
    out.backward(grad_out)
    return out.detach(), [None if t is None else t.grad for t in tensors]


def make_mlp_tensors(batch_shape, in_features, hidden, out_features, bias1, bias2, dtype, device):
    def param(*shape, scale):
        return (torch.randn(*shape, device=device, dtype=dtype) * scale).requires_grad_()

    x = torch.randn(*batch_shape, in_features, device=device, dtype=dtype).requires_grad_()
    w1 = param(hidden, in_features, scale=in_features ** -0.5)
    b1 = param(hidden, scale=0.5) if bias1 else None
    w2 = param(out_features, hidden, scale=hidden ** -0.5)
    b2 = param(out_features, scale=0.5) if bias2 else None
    return x, w1, b1, w2, b2


# ----------------------------------------------------------------------------------------------
# CPU: the plain fallback path


@pytest.mark.parametrize("batch_shape", [(7,), (2, 5)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("return_residual", [False, True])
def test_fused_dense_fallback_equals_nn_linear(batch_shape, bias, return_residual):
    torch.manual_seed(0)
    ref = nn.Linear(24, 40, bias=bias)
    layer = FusedDense(24, 40, bias=bias, return_residual=return_residual)
    layer.load_state_dict(ref.state_dict())
    x = torch.randn(*batch_shape, 24, requires_grad=True)
    x_ref = leaf(x)
    out = layer(x)
    if return_residual:
        out, residual = out
        assert residual is x
    out_ref = ref(x_ref)
    assert torch.equal(out, out_ref)
    grad = torch.randn_like(out)
    out.backward(grad)
    out_ref.backward(grad)
    assert torch.equal(x.grad, x_ref.grad)
    assert torch.equal(layer.weight.grad, ref.weight.grad)
    if bias:
        assert torch.equal(layer.bias.grad, ref.bias.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("checkpoint_lvl", [0, 2])
@pytest.mark.parametrize("bias1,bias2", [(True, True), (False, True), (True, False)])
def test_fused_mlp_fallback_equals_plain_mlp(dtype, activation, checkpoint_lvl, bias1, bias2):
    torch.manual_seed(0)
    mlp = FusedMLP(16, 48, 24, bias1=bias1, bias2=bias2, activation=activation, checkpoint_lvl=checkpoint_lvl,
                   dtype=dtype)
    x = torch.randn(3, 5, 16, dtype=dtype, requires_grad=True)
    grad = torch.randn(3, 5, 24, dtype=dtype)
    params = [mlp.fc1.weight, mlp.fc1.bias, mlp.fc2.weight, mlp.fc2.bias]
    out_ref, grads_ref = run_with_grads(
        lambda x, w1, b1, w2, b2: plain_mlp(x, w1, b1, w2, b2, activation), [x] + params, grad)
    out = mlp(x)
    out.backward(grad)
    assert torch.equal(out, out_ref)
    for got, want in zip([x.grad] + [p.grad if p is not None else None for p in params], grads_ref):
        assert (got is None) == (want is None)
        if got is not None:
            assert torch.equal(got, want)


def test_fused_mlp_defaults_and_bad_arguments():
    mlp = FusedMLP(8)
    assert mlp.fc1.weight.shape == (32, 8) and mlp.fc2.weight.shape == (8, 32)
    assert mlp.heuristic == "auto"
    with pytest.raises(ValueError, match="activation"):
        FusedMLP(8, activation="swish")
    with pytest.raises(ValueError, match="checkpoint_lvl"):
        FusedMLP(8, checkpoint_lvl=3)
    x, w1, b1, w2, b2 = make_mlp_tensors((4,), 8, 16, 8, True, True, torch.float32, "cpu")
    with pytest.raises(ValueError, match="activation"):
        fused_mlp_func(x, w1, w2, b1, b2, activation="gelu")


def test_fused_mlp_return_residual_fallback():
    torch.manual_seed(0)
    mlp = FusedMLP(8, 16, return_residual=True)
    x = torch.randn(5, 8, requires_grad=True)
    out, residual = mlp(x)
    assert residual is x and out.shape == (5, 8)


# ----------------------------------------------------------------------------------------------
# CPU: the fused paths' autograd plumbing, on a PyTorch stand-in for fused_dense_lib


def pack_bits(positive):
    """uint8 [rows, cols / 8], bit j of byte k = element 8k + j (our stand-in's layout)."""
    rows, cols = positive.shape
    weights = 1 << torch.arange(8, device=positive.device)
    return (positive.reshape(rows, cols // 8, 8).long() * weights).sum(-1).to(torch.uint8)


def unpack_bits(mask):
    bits = (mask.long().unsqueeze(-1) >> torch.arange(8, device=mask.device)) & 1
    return bits.reshape(mask.shape[0], -1)


class FakeFusedDenseLib:
    """fused_dense_lib's contract (arguments, outputs, the checks the Python side must satisfy)
    in PyTorch, computing in the inputs' dtype."""

    max_heuristic_algos = 5

    def __init__(self):
        self.calls = collections.Counter()
        self.forward_saves = []

    @staticmethod
    def _check(*tensors):
        for t in tensors:
            assert t is None or (t.is_contiguous() and t.dim() in (1, 2)), "fused_dense_lib needs contiguous 2-D"

    def linear_act_forward(self, input, weight, bias, is_gelu, save_pre_act, heuristic):
        self._check(input, weight, bias)
        assert heuristic >= 0 and (not save_pre_act or weight.shape[0] % (8 if is_gelu else 128) == 0)
        self.calls["linear_act_forward"] += 1
        self.forward_saves.append(save_pre_act)
        pre_act = F.linear(input, weight, bias)
        out = F.gelu(pre_act, approximate="tanh") if is_gelu else F.relu(pre_act)
        if not save_pre_act:
            return [out]
        return [out, pre_act if is_gelu else pack_bits(pre_act > 0)]

    def linear_bias_wgrad(self, input, d_output, has_d_bias, fp32_grads=False):
        self._check(input, d_output)
        self.calls["linear_bias_wgrad"] += 1
        self.calls["fp32_grads"] += fp32_grads
        self.calls["bgradb_epilogue"] += has_d_bias
        grads = [d_output.t() @ input, d_output.sum(0) if has_d_bias else None]
        return [g.float() if fp32_grads and g is not None else g for g in grads]

    def bias_act_linear_dgrad_bgrad(self, weight, d_output, pre_act, is_gelu, heuristic):
        self._check(weight, d_output, pre_act)
        assert pre_act.dtype == (weight.dtype if is_gelu else torch.uint8)
        self.calls["bias_act_linear_dgrad_bgrad"] += 1
        d_act_out = d_output @ weight
        d_input = gelu_bwd(d_act_out, pre_act) if is_gelu else d_act_out * unpack_bits(pre_act)
        return [d_input, d_input.sum(0)]

    def act_linear_dgrad(self, weight, d_output, pre_act, is_gelu, heuristic):
        self._check(weight, d_output, pre_act)
        assert heuristic >= 0 and pre_act.dtype == (weight.dtype if is_gelu else torch.uint8)
        self.calls["act_linear_dgrad"] += 1
        d_act_out = d_output @ weight
        return gelu_bwd(d_act_out, pre_act) if is_gelu else d_act_out * unpack_bits(pre_act)

    def linear_act_forward_num_algos(self, input, weight, bias, is_gelu, save_pre_act):
        return 3

    def bias_act_linear_dgrad_bgrad_num_algos(self, weight, d_output, pre_act, is_gelu):
        return 2

    def act_linear_dgrad_num_algos(self, weight, d_output, pre_act, is_gelu):
        return 2


@pytest.fixture
def fake_ext(monkeypatch):
    """Route the fused paths to FakeFusedDenseLib for float64 CPU tensors."""
    fake = FakeFusedDenseLib()
    monkeypatch.setattr(fd, "_ext", lambda: fake)
    monkeypatch.setattr(fd, "_on_one_cuda_device", lambda *ts: all(t.device.type == "cpu" for t in ts if t is not None))
    monkeypatch.setattr(fd, "_HALF_DTYPES", (torch.float64,))
    monkeypatch.setattr(autotune, "AUTO_PLANS", {})
    return fake


def assert_close64(got, want):
    assert (got is None) == (want is None)
    if got is not None:
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


HEURISTICS = [-1, 0, 2, (0, -1), (-1, 1), (1, 0, -1)]


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("checkpoint_lvl", [0, 1, 2])
@pytest.mark.parametrize("heuristic", HEURISTICS)
@pytest.mark.parametrize("return_residual", [False, True])
def test_fused_mlp_func_paths(fake_ext, activation, checkpoint_lvl, heuristic, return_residual):
    if activation == "sqrelu" and heuristic != -1:
        pytest.skip("sqrelu runs unfused only")
    torch.manual_seed(0)
    tensors = make_mlp_tensors((3, 5), 16, 256, 24, True, True, torch.float64, "cpu")
    grad = torch.randn(3, 5, 24, dtype=torch.float64)
    grad_residual = torch.randn(3, 5, 16, dtype=torch.float64)

    out_ref, grads_ref = run_with_grads(lambda *t: plain_mlp(*t, activation), tensors, grad)
    if return_residual:  # the residual's gradient adds straight onto x's
        grads_ref[0] = grads_ref[0] + grad_residual
    x, w1, b1, w2, b2 = [leaf(t) for t in tensors]
    result = fused_mlp_func(x, w1, w2, b1, b2, activation=activation, return_residual=return_residual,
                            checkpoint_lvl=checkpoint_lvl, heuristic=heuristic)
    if return_residual:
        out, residual = result
        torch.autograd.backward([out, residual], [grad, grad_residual])
    else:
        out = result
        out.backward(grad)
    assert_close64(out, out_ref)
    for got, want in zip([x.grad, w1.grad, b1.grad, w2.grad, b2.grad], grads_ref):
        assert_close64(got, want)
    fwd_h, bwd_h, wgrad_h = (heuristic + (0,))[:3] if isinstance(heuristic, tuple) else (heuristic, heuristic, 0)
    if activation == "relu" and fwd_h < 0:
        bwd_h = -1  # the fused ReLU backward needs the fused forward's bit-mask
    assert (fake_ext.calls["linear_act_forward"] > 0) == (fwd_h >= 0)
    # The fused backward is DGELU / DRELU alone: bias1's gradient comes with its weight gradient.
    assert (fake_ext.calls["act_linear_dgrad"] > 0) == (bwd_h >= 0)
    assert fake_ext.calls["bias_act_linear_dgrad_bgrad"] == 0
    # The weight gradients of both GEMMs, unless PyTorch's mm + sum was chosen for them.
    assert fake_ext.calls["linear_bias_wgrad"] == (2 if wgrad_h >= 0 else 0)


@pytest.mark.parametrize("needs", ["x", "weights", "biases"])
def test_fused_mlp_func_partial_grads(fake_ext, needs):
    torch.manual_seed(0)
    tensors = make_mlp_tensors((6,), 16, 128, 8, True, True, torch.float64, "cpu")
    for i, t in enumerate(tensors):
        t.requires_grad_({"x": i == 0, "weights": i in (1, 3), "biases": i in (2, 4)}[needs])
    grad = torch.randn(6, 8, dtype=torch.float64)
    out_ref, grads_ref = run_with_grads(lambda *t: plain_mlp(*t, "gelu_approx"), tensors, grad)
    x, w1, b1, w2, b2 = [leaf(t) for t in tensors]
    out = fused_mlp_func(x, w1, w2, b1, b2, heuristic=0)
    out.backward(grad)
    for got, want in zip([x.grad, w1.grad, b1.grad, w2.grad, b2.grad], grads_ref):
        assert_close64(got, want)


def test_fused_mlp_sqrelu_rejects_fused_heuristic(fake_ext):
    x, w1, b1, w2, b2 = make_mlp_tensors((4,), 16, 32, 16, True, True, torch.float64, "cpu")
    with pytest.raises(ValueError, match="sqrelu"):
        fused_mlp_func(x, w1, w2, b1, b2, activation="sqrelu", heuristic=0)
    assert FusedMLP(16, activation="sqrelu").heuristic == -1


def test_fused_mlp_eval_mode_recomputes(fake_ext):
    """Eval mode saves no activation input; a backward anyway recomputes it (checkpoint_lvl 2)."""
    torch.manual_seed(0)
    mlp = FusedMLP(16, 128, activation="relu", heuristic=0, dtype=torch.float64).eval()
    x = torch.randn(4, 16, dtype=torch.float64, requires_grad=True)
    out = mlp(x)
    assert fake_ext.forward_saves == [False]
    out.sum().backward()
    assert fake_ext.forward_saves == [False, True]  # recomputed with the bit-mask for the fused backward
    x_ref = leaf(x)
    plain_mlp(x_ref, mlp.fc1.weight, mlp.fc1.bias, mlp.fc2.weight, mlp.fc2.bias, "relu").sum().backward()
    assert_close64(x.grad, x_ref.grad)


def test_mlp_eligibility(fake_ext):
    x, w1, b1, w2, b2 = make_mlp_tensors((4,), 16, 200, 16, True, True, torch.float64, "cpu")
    assert fd._mlp_eligible(x, w1, w2, b1, b2, "gelu_approx")
    assert not fd._mlp_eligible(x, w1, w2, b1, b2, "relu")  # 200 hidden is not a multiple of 128
    assert fd._mlp_eligible(x, w1, w2, b1, b2, "sqrelu")
    assert not fd._mlp_eligible(x[:1], w1, w2, b1, b2, "gelu_approx")  # one row: plain GEMV path
    assert not fd._mlp_eligible(x.float(), w1, w2, b1, b2, "gelu_approx")  # mixed dtypes
    # Ineligible: the plain path, not the extension.
    out = fused_mlp_func(x, w1, w2, b1, b2, activation="relu", heuristic=0)
    assert sum(fake_ext.calls.values()) == 0
    assert torch.equal(out, plain_mlp(x, w1, b1, w2, b2, "relu"))


def skip_cpu_bias_grad_without_interpreter(bias_grad_apart):
    """These tests run bias_grad on CPU tensors, which needs Triton's interpreter: conftest turns it
    on only where CUDA is absent. On a GPU machine test_fused_layers_in_cuda_graph_match_eager
    takes bias_grad's path on CUDA instead."""
    if bias_grad_apart and not triton_interpreter_enabled():
        pytest.skip("bias_grad on CPU tensors needs TRITON_INTERPRET=1 (set on CPU-only machines)")


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("return_residual", [False, True])
@pytest.mark.parametrize("frozen_weight", [False, True])
@pytest.mark.parametrize("bias_grad_apart", [False, True])
def test_fused_dense_func_paths(fake_ext, monkeypatch, bias, return_residual, frozen_weight, bias_grad_apart):
    """bias_grad_apart: the bias gradient from Triton's bias_grad (CUDA graphs on sm90 and up)
    rather than the GEMM's BGRADB epilogue."""
    skip_cpu_bias_grad_without_interpreter(bias_grad_apart)
    monkeypatch.setattr(fd, "_bias_grad_apart", lambda grad_output: bias_grad_apart)
    torch.manual_seed(0)
    x = torch.randn(3, 5, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(24, 16, dtype=torch.float64, requires_grad=not frozen_weight)
    b = torch.randn(24, dtype=torch.float64, requires_grad=True) if bias else None
    grad = torch.randn(3, 5, 24, dtype=torch.float64)
    out_ref, grads_ref = run_with_grads(F.linear, [x, weight, b], grad)
    xs, ws, bs = leaf(x), leaf(weight), None if b is None else leaf(b)
    result = fused_dense_func(xs, ws, bs, return_residual=return_residual)
    out = result[0] if return_residual else result
    out.backward(grad)
    assert_close64(out, out_ref)
    for got, want in zip([xs.grad, ws.grad, None if bs is None else bs.grad], grads_ref):
        assert_close64(got, want)
    assert fake_ext.calls["linear_bias_wgrad"] == (0 if frozen_weight else 1)
    assert fake_ext.calls["bgradb_epilogue"] == (0 if frozen_weight or bias_grad_apart else int(bias))


@pytest.mark.parametrize("layer", ["dense", "mlp"])
@pytest.mark.parametrize("bias_grad_apart", [False, True])
def test_autocast_fp32_parameters_get_fp32_fused_weight_grads(fake_ext, monkeypatch, layer, bias_grad_apart):
    """Half-precision compute (autocast) on fp32 parameters: the fused weight-gradient GEMMs are
    asked for fp32 gradients (no cast after them), and so is bias_grad where it takes the bias
    gradients (bias_grad_apart); the gradients match the plain layer's."""
    skip_cpu_bias_grad_without_interpreter(bias_grad_apart)
    monkeypatch.setattr(fd, "_HALF_DTYPES", (torch.bfloat16,))
    monkeypatch.setattr(fd, "_bias_grad_apart", lambda grad_output: bias_grad_apart)
    torch.manual_seed(0)
    fused = (FusedDense(16, 24) if layer == "dense"
             else FusedMLP(16, 128, 24, activation="gelu_approx", heuristic=0))
    plain = (nn.Linear(16, 24) if layer == "dense"
             else nn.Sequential(nn.Linear(16, 128), nn.GELU(approximate="tanh"), nn.Linear(128, 24)))
    plain.load_state_dict(dict(zip(plain.state_dict(), fused.state_dict().values())))
    x = torch.randn(4, 6, 16)
    for module in (fused, plain):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = module(x)
        out.float().square().sum().backward()
    gemms = 1 if layer == "dense" else 2
    assert fake_ext.calls["linear_bias_wgrad"] == gemms and fake_ext.calls["fp32_grads"] == gemms
    assert fake_ext.calls["bgradb_epilogue"] == (0 if bias_grad_apart else gemms)
    for (name, got), want in zip(fused.named_parameters(), plain.parameters()):
        assert got.grad.dtype == torch.float32, name
        torch.testing.assert_close(got.grad, want.grad, rtol=2e-2, atol=2e-2, msg=name)


def test_half_parameters_get_half_fused_weight_grads(fake_ext):
    x = torch.randn(6, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(24, 16, dtype=torch.float64, requires_grad=True)
    fused_dense_func(x, weight, None).sum().backward()
    assert fake_ext.calls["linear_bias_wgrad"] == 1 and fake_ext.calls["fp32_grads"] == 0


def scripted_timer(tables, log):
    """A stand-in for autotune._time_candidates answering from tables {"fwd"|"wgrad"|"bwd": {candidate: ms}}."""

    def measure_one(fn):
        if fn.func is fd._act_forward:
            stage, h = "fwd", fn.args[4]
        else:  # _tune_mlp's local functions
            stage, h = {"wgrads": "wgrad", "backward": "bwd", "whole_step": "whole"}[fn.func.__name__], fn.args[0]
        log.append((stage, h))
        return tables[stage][h]

    def measure(fns, **kwargs):
        return {key: measure_one(fn) for key, fn in fns.items()}

    return measure


@pytest.mark.parametrize("activation,tables,training,plan", [
    # each stage chosen on its own; a "win" within 1% goes to what heuristic=-1 runs
    ("gelu_approx", dict(fwd={-1: 10, 0: 9.5, 1: 8, 2: 9}, wgrad={-1: 5, 0: 5.02}, bwd={-1: 10, 0: 9.95, 1: 11},
                         whole={(-1, -1, -1): 30, (1, -1, 0): 28}),
     True, (1, -1, 0)),
    ("gelu_approx", dict(fwd={-1: 10, 0: 9.95, 1: 12, 2: 10.5}, wgrad={-1: 4, 0: 5}, bwd={-1: 10, 0: 8, 1: 7},
                         whole={(-1, -1, -1): 30, (-1, 1, -1): 29}),
     True, (-1, 1, -1)),
    # the stages' winners lose as a whole step (or win within the noise): the unfused plan runs
    ("gelu_approx", dict(fwd={-1: 10, 0: 9.5, 1: 8, 2: 9}, wgrad={-1: 5, 0: 5.02}, bwd={-1: 10, 0: 9.95, 1: 11},
                         whole={(-1, -1, -1): 30, (1, -1, 0): 29.9}),
     True, (-1, -1, -1)),
    ("gelu_approx", dict(fwd={-1: 10, 0: 11, 1: 9, 2: 12}), False, (1, -1, 0)),
    # ReLU: a fused backward needs the fused forward's bit-mask, so the pairs are compared
    ("relu", dict(fwd={-1: 10, 0: 10.5, 1: 11, 2: 12}, wgrad={-1: 6, 0: 5}, bwd={-1: 10, 0: 8, 1: 9},
                  whole={(-1, -1, -1): 30, (0, 0, 0): 25}),
     True, (0, 0, 0)),
    ("relu", dict(fwd={-1: 10, 0: 10.5, 1: 11, 2: 12}, wgrad={-1: 6, 0: 5}, bwd={-1: 10, 0: 9.5, 1: 9.9},
                  whole={(-1, -1, -1): 30, (-1, -1, 0): 29}),
     True, (-1, -1, 0)),
])
def test_auto_plan(fake_ext, monkeypatch, activation, tables, training, plan):
    log = []
    monkeypatch.setattr(autotune, "_time_candidates", scripted_timer(tables, log))
    torch.manual_seed(0)
    mlp = FusedMLP(16, 128, activation=activation, dtype=torch.float64).train(training)
    x = torch.randn(2, 3, 16, dtype=torch.float64, requires_grad=True)
    mlp(x).sum().backward()
    assert autotune.AUTO_PLANS == {(6, 16, 128, 16, torch.float64, x.device, activation, True, True, training): plan}
    expected = [("fwd", h) for h in (-1, 0, 1, 2)]
    if training:
        expected += [("wgrad", -1), ("wgrad", 0)] + [("bwd", h) for h in (-1, 0, 1)]
        expected += [("whole", candidate) for candidate in tables["whole"]]
    assert log == expected
    mlp(x).sum().backward()  # cached: nothing timed again
    assert len(log) == len(expected)
    x_ref = leaf(x)
    plain_mlp(x_ref, mlp.fc1.weight, mlp.fc1.bias, mlp.fc2.weight, mlp.fc2.bias, activation).sum().backward()
    assert_close64(x.grad, 2 * x_ref.grad)


# ----------------------------------------------------------------------------------------------
# GPU: the extension


def assert_within_reference(name, ours, ref_lowp, ref_fp32, slack=1e-4):
    """|ours - fp32 reference| <= 2 |PyTorch in the same dtype - fp32 reference| + a small slack."""
    ours, ref_lowp, ref_fp32 = ours.float(), ref_lowp.float(), ref_fp32.float()
    assert torch.isfinite(ours).all(), f"{name}: non-finite values"
    err = (ours - ref_fp32).abs().max().item()
    base = (ref_lowp - ref_fp32).abs().max().item()
    bound = 2 * base + slack * (1 + ref_fp32.abs().max().item())
    assert err <= bound, f"{name}: max error {err:.3g} > {bound:.3g} (PyTorch in the same dtype: {base:.3g})"


def popcount_rows(mask):
    return unpack_bits(mask).sum(1)


def load_ext():
    from flash_attn._native import load_extension

    return load_extension("fused_dense_lib")


DTYPES = [torch.float16, torch.bfloat16]
SHAPES = [(97, 256, 384), (1025, 512, 1024), (8, 1024, 128)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_gelu", [True, False])
@pytest.mark.parametrize("has_bias", [True, False])
@pytest.mark.parametrize("save_pre_act", [True, False])
@pytest.mark.parametrize("heuristic", [0, 1, 4])
@pytest.mark.parametrize("batch,in_features,out_features", SHAPES)
def test_linear_act_forward(dtype, is_gelu, has_bias, save_pre_act, heuristic, batch, in_features, out_features):
    ext = load_ext()
    torch.manual_seed(0)
    x = torch.randn(batch, in_features, device="cuda", dtype=dtype)
    w = torch.randn(out_features, in_features, device="cuda", dtype=dtype) / math.sqrt(in_features)
    b = torch.randn(out_features, device="cuda", dtype=dtype) if has_bias else None
    outs = ext.linear_act_forward(x, w, b, is_gelu, save_pre_act, heuristic)
    assert len(outs) == (2 if save_pre_act else 1)
    act = activation_fn("gelu_approx" if is_gelu else "relu")
    pre32 = F.linear(x.float(), w.float(), None if b is None else b.float())
    pre_lowp = F.linear(x, w, b)
    assert outs[0].shape == (batch, out_features) and outs[0].dtype == dtype
    assert_within_reference("output", outs[0], act(pre_lowp), act(pre32))
    if save_pre_act and is_gelu:
        assert outs[1].shape == (batch, out_features) and outs[1].dtype == dtype
        assert_within_reference("pre_act", outs[1], pre_lowp, pre32)
    elif save_pre_act:
        assert outs[1].shape == (batch, out_features // 8) and outs[1].dtype == torch.uint8
        # One bit per element, one row of bytes per batch row: the set bits of a row count its positives.
        assert torch.equal(popcount_rows(outs[1]), (outs[0] > 0).sum(1))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("has_d_bias", [True, False])
@pytest.mark.parametrize("batch,in_features,out_features", SHAPES)
@pytest.mark.parametrize("fp32_grads", [False, True])
def test_linear_bias_wgrad(dtype, has_d_bias, batch, in_features, out_features, fp32_grads):
    ext = load_ext()
    torch.manual_seed(0)
    x = torch.randn(batch, in_features, device="cuda", dtype=dtype)
    g = torch.randn(batch, out_features, device="cuda", dtype=dtype)
    d_weight, d_bias = ext.linear_bias_wgrad(x, g, has_d_bias, fp32_grads=fp32_grads)
    grad_dtype = torch.float32 if fp32_grads else dtype
    assert d_weight.shape == (out_features, in_features) and d_weight.dtype == grad_dtype
    assert_within_reference("d_weight", d_weight, g.t() @ x, g.float().t() @ x.float())
    if has_d_bias:
        assert d_bias.shape == (out_features,) and d_bias.dtype == grad_dtype
        assert_within_reference("d_bias", d_bias, g.sum(0), g.float().sum(0))
    else:
        assert d_bias is None


def _dgrad_case(dtype, is_gelu, batch, hidden, out_features):
    """(ext, aux, w2, g, reference) of a backward-through-the-activation case: aux is the
    pre-activation linear_act_forward saved; reference(g, w2) = act'(aux) * (g @ w2) in g's dtype."""
    ext = load_ext()
    torch.manual_seed(0)
    x = torch.randn(batch, 64, device="cuda", dtype=dtype)
    w1 = torch.randn(hidden, 64, device="cuda", dtype=dtype) / 8
    output1, aux = ext.linear_act_forward(x, w1, None, is_gelu, True, 0)
    w2 = torch.randn(out_features, hidden, device="cuda", dtype=dtype) / math.sqrt(hidden)
    g = torch.randn(batch, out_features, device="cuda", dtype=dtype)

    def reference(g, w2):
        d_act = g @ w2
        return gelu_bwd(d_act, aux.to(d_act.dtype)) if is_gelu else d_act * (output1 > 0)

    return ext, aux, w2, g, reference


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_gelu", [True, False])
@pytest.mark.parametrize("heuristic", [0, 1, 2, 3, 4])
@pytest.mark.parametrize("batch,hidden,out_features", SHAPES)
def test_bias_act_linear_dgrad_bgrad(dtype, is_gelu, heuristic, batch, hidden, out_features):
    ext, aux, w2, g, reference = _dgrad_case(dtype, is_gelu, batch, hidden, out_features)
    d_input, d_bias = ext.bias_act_linear_dgrad_bgrad(w2, g, aux, is_gelu, heuristic)
    assert d_input.shape == (batch, hidden) and d_input.dtype == dtype and d_bias.shape == (hidden,)

    ref32, ref_lowp = reference(g.float(), w2.float()), reference(g, w2)
    assert_within_reference("d_input", d_input, ref_lowp, ref32)
    # PyTorch's bias gradient is rounded to the dtype once, after an fp32 sum.
    assert_within_reference("d_bias", d_bias, ref_lowp.float().sum(0).to(dtype), ref32.sum(0))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_gelu", [True, False])
@pytest.mark.parametrize("heuristic", [0, 1, 4])
@pytest.mark.parametrize("batch,hidden,out_features", SHAPES)
def test_act_linear_dgrad(dtype, is_gelu, heuristic, batch, hidden, out_features):
    ext, aux, w2, g, reference = _dgrad_case(dtype, is_gelu, batch, hidden, out_features)
    d_input = ext.act_linear_dgrad(w2, g, aux, is_gelu, heuristic)
    assert d_input.shape == (batch, hidden) and d_input.dtype == dtype

    assert_within_reference("d_input", d_input, reference(g, w2), reference(g.float(), w2.float()))
    assert 1 <= ext.act_linear_dgrad_num_algos(w2, g, aux, is_gelu) <= ext.max_heuristic_algos


@pytest.mark.gpu
def test_num_algos():
    ext = load_ext()
    x = torch.randn(1024, 512, device="cuda", dtype=torch.bfloat16)
    w1 = torch.randn(2048, 512, device="cuda", dtype=torch.bfloat16)
    w2 = torch.randn(512, 2048, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(1024, 512, device="cuda", dtype=torch.bfloat16)
    for is_gelu in (True, False):
        n = ext.linear_act_forward_num_algos(x, w1, None, is_gelu, True)
        assert 1 <= n <= ext.max_heuristic_algos
        _, aux = ext.linear_act_forward(x, w1, None, is_gelu, True, 0)
        n = ext.bias_act_linear_dgrad_bgrad_num_algos(w2, g, aux, is_gelu)
        assert 1 <= n <= ext.max_heuristic_algos


BAD_CALLS = {
    "fp32 input": (lambda e, x, w, b: e.linear_act_forward(x.float(), w, b, True, True, 0), "input must have dtype"),
    "weight dtype": (lambda e, x, w, b: e.linear_act_forward(x, w.half(), b, True, True, 0), "weight must have dtype"),
    "cpu input": (lambda e, x, w, b: e.linear_act_forward(x.cpu(), w, b, True, True, 0), "input must be a CUDA"),
    "weight shape": (lambda e, x, w, b: e.linear_act_forward(x, w[:, :64].contiguous(), b, True, True, 0),
                     "weight must have shape"),
    "bias shape": (lambda e, x, w, b: e.linear_act_forward(x, w, b[:8], True, True, 0), "bias must have shape"),
    "strided input": (lambda e, x, w, b: e.linear_act_forward(torch.cat([x, x], 1)[:, ::2], w, b, True, True, 0),
                      "input must be contiguous"),
    "empty input": (lambda e, x, w, b: e.linear_act_forward(x[:0], w, b, True, True, 0), "input must not be empty"),
    "negative heuristic": (lambda e, x, w, b: e.linear_act_forward(x, w, b, True, True, -1), "heuristic must be"),
    "relu mask width": (lambda e, x, w, b: e.linear_act_forward(x, w[:200].contiguous(), b[:200].contiguous(), False,
                                                                True, 0), "multiple of 128"),
    "wgrad d_output rows": (lambda e, x, w, b: e.linear_bias_wgrad(x, x[:5].contiguous(), True),
                            "d_output must have shape"),
    "dgrad pre_act dtype": (lambda e, x, w, b: e.bias_act_linear_dgrad_bgrad(
        w.t().contiguous(), x, torch.zeros(16, 256, device="cuda", dtype=x.dtype), False, 0),
        "pre_act must have dtype"),
    "dgrad d_output shape": (lambda e, x, w, b: e.bias_act_linear_dgrad_bgrad(w, x, x, True, 0),
                             "d_output must have shape"),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_bad_inputs_name_the_argument(case):
    ext = load_ext()
    x = torch.randn(16, 128, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(256, 128, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(256, device="cuda", dtype=torch.bfloat16)
    call, message = BAD_CALLS[case]
    with pytest.raises(RuntimeError, match=message):
        call(ext, x, w, b)


# ----------------------------------------------------------------------------------------------
# GPU: the layers


def lowp_and_fp32(fn, tensors, grad):
    """fn on the tensors as given and upcast to fp32, each with its gradients."""
    lowp = run_with_grads(fn, tensors, grad)
    fp32 = run_with_grads(fn, [None if t is None else t.float() for t in tensors], grad.float())
    return lowp, fp32


def check_against_references(names, ours, lowp, fp32):
    (out, grads), (out_lowp, grads_lowp), (out32, grads32) = ours, lowp, fp32
    assert out.dtype == out_lowp.dtype
    assert_within_reference("output", out, out_lowp, out32)
    for name, g, g_lowp, g32 in zip(names, grads, grads_lowp, grads32):
        assert (g is None) == (g_lowp is None), name
        if g is not None:
            assert g.dtype == g_lowp.dtype, name
            assert_within_reference(name, g, g_lowp, g32)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("has_bias", [True, False])
@pytest.mark.parametrize("return_residual", [False, True])
@pytest.mark.parametrize("batch_shape", [(1025,), (3, 67)])
def test_fused_dense_gpu(dtype, has_bias, return_residual, batch_shape):
    load_ext()
    torch.manual_seed(0)
    layer = FusedDense(256, 512, bias=has_bias, return_residual=return_residual, device="cuda", dtype=dtype)
    x = torch.randn(*batch_shape, 256, device="cuda", dtype=dtype, requires_grad=True)
    assert fd._dense_eligible(x, layer.weight, layer.bias)
    grad = torch.randn(*batch_shape, 512, device="cuda", dtype=dtype)
    tensors = [x, layer.weight, layer.bias]
    lowp, fp32 = lowp_and_fp32(F.linear, tensors, grad)
    out = layer(x)
    if return_residual:
        out, residual = out
        assert residual.data_ptr() == x.data_ptr()
    out.backward(grad)
    ours = (out.detach(), [x.grad, layer.weight.grad, layer.bias.grad if has_bias else None])
    check_against_references(["x.grad", "weight.grad", "bias.grad"], ours, lowp, fp32)


MLP_HEURISTICS = [-1, 0, 1, 4, (0, 1, -1), "auto"]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("checkpoint_lvl", [0, 1, 2])
@pytest.mark.parametrize("heuristic", MLP_HEURISTICS)
@pytest.mark.parametrize("batch_shape", [(1025,), (3, 67)])
def test_fused_mlp_gpu(dtype, activation, checkpoint_lvl, heuristic, batch_shape):
    if activation == "sqrelu" and heuristic not in (-1, "auto"):
        pytest.skip("sqrelu runs unfused only")
    load_ext()
    torch.manual_seed(0)
    mlp = FusedMLP(256, 1024, 384, activation=activation, checkpoint_lvl=checkpoint_lvl, heuristic=heuristic,
                   device="cuda", dtype=dtype)
    x = torch.randn(*batch_shape, 256, device="cuda", dtype=dtype, requires_grad=True)
    params = [mlp.fc1.weight, mlp.fc1.bias, mlp.fc2.weight, mlp.fc2.bias]
    assert fd._mlp_eligible(x, params[0], params[2], params[1], params[3], activation)
    grad = torch.randn(*batch_shape, 384, device="cuda", dtype=dtype)
    lowp, fp32 = lowp_and_fp32(lambda *t: plain_mlp(*t, activation), [x] + params, grad)
    out = mlp(x)
    out.backward(grad)
    ours = (out.detach(), [x.grad] + [p.grad for p in params])
    check_against_references(["x.grad", "fc1.weight.grad", "fc1.bias.grad", "fc2.weight.grad", "fc2.bias.grad"],
                             ours, lowp, fp32)


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["gelu_approx", "relu"])
@pytest.mark.parametrize("bias1,bias2", [(False, True), (True, False)])
def test_fused_mlp_gpu_without_biases(activation, bias1, bias2):
    load_ext()
    torch.manual_seed(0)
    mlp = FusedMLP(128, 512, bias1=bias1, bias2=bias2, activation=activation, heuristic=0, device="cuda",
                   dtype=torch.bfloat16)
    x = torch.randn(333, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    params = [mlp.fc1.weight, mlp.fc1.bias, mlp.fc2.weight, mlp.fc2.bias]
    grad = torch.randn(333, 128, device="cuda", dtype=torch.bfloat16)
    lowp, fp32 = lowp_and_fp32(lambda *t: plain_mlp(*t, activation), [x] + params, grad)
    out = mlp(x)
    out.backward(grad)
    ours = (out.detach(), [x.grad] + [None if p is None else p.grad for p in params])
    check_against_references(["x.grad", "fc1.weight.grad", "fc1.bias.grad", "fc2.weight.grad", "fc2.bias.grad"],
                             ours, lowp, fp32)


@pytest.mark.gpu
@pytest.mark.parametrize("autocast_dtype", DTYPES)
@pytest.mark.parametrize("activation", ["gelu_approx", "relu"])
def test_fused_mlp_and_dense_under_autocast(autocast_dtype, activation):
    load_ext()
    torch.manual_seed(0)
    mlp = FusedMLP(256, 1024, activation=activation, heuristic=0, device="cuda")  # fp32 parameters
    x = torch.randn(4, 129, 256, device="cuda", requires_grad=True)
    params = [mlp.fc1.weight, mlp.fc1.bias, mlp.fc2.weight, mlp.fc2.bias]
    grad = torch.randn(4, 129, 256, device="cuda", dtype=autocast_dtype)
    leaves = [leaf(t) for t in [x] + params]
    with torch.autocast("cuda", dtype=autocast_dtype):
        assert fd._mlp_eligible(x, params[0], params[2], params[1], params[3], activation)
        out_lowp = plain_mlp(*leaves, activation)
        out = mlp(x)
    out_lowp.backward(grad)  # backward outside autocast, as PyTorch recommends
    lowp = (out_lowp.detach(), [t.grad for t in leaves])
    fp32 = run_with_grads(lambda *t: plain_mlp(*t, activation), [x] + params, grad.float())
    assert out.dtype == autocast_dtype
    out.backward(grad)
    ours = (out.detach(), [x.grad] + [p.grad for p in params])
    assert all(g.dtype == torch.float32 for g in ours[1])
    check_against_references(["x.grad", "fc1.weight.grad", "fc1.bias.grad", "fc2.weight.grad", "fc2.bias.grad"],
                             ours, lowp, fp32)

    layer = FusedDense(256, 64, device="cuda")
    with torch.autocast("cuda", dtype=autocast_dtype):
        out = layer(x)
        ref = F.linear(x, layer.weight, layer.bias)
    assert out.dtype == autocast_dtype and torch.equal(out, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["fp32 without autocast", "relu width", "one row", "unaligned features"])
def test_fused_mlp_gpu_fallbacks_equal_plain_mlp(case):
    load_ext()
    torch.manual_seed(0)
    dtype = torch.float32 if case == "fp32 without autocast" else torch.bfloat16
    hidden = 200 if case == "relu width" else 256
    in_features = 60 if case == "unaligned features" else 64
    rows = 1 if case == "one row" else 97
    mlp = FusedMLP(in_features, hidden, activation="relu", heuristic=0, device="cuda", dtype=dtype)
    x = torch.randn(rows, in_features, device="cuda", dtype=dtype, requires_grad=True)
    params = [mlp.fc1.weight, mlp.fc1.bias, mlp.fc2.weight, mlp.fc2.bias]
    assert not fd._mlp_eligible(x, params[0], params[2], params[1], params[3], "relu")
    grad = torch.randn(rows, in_features, device="cuda", dtype=dtype)
    out_ref, grads_ref = run_with_grads(lambda *t: plain_mlp(*t, "relu"), [x] + params, grad)
    out = mlp(x)
    out.backward(grad)
    assert torch.equal(out, out_ref)
    for got, want in zip([x.grad] + [p.grad for p in params], grads_ref):
        assert torch.equal(got, want)



def test_auto_plan_while_capturing(fake_ext, monkeypatch):
    """While a CUDA graph captures (or torch.compile traces) nothing can be timed: the plan cached
    by the warm-up steps runs, and an untuned problem runs unfused without being cached."""
    tables = dict(fwd={-1: 10, 0: 9.5, 1: 8, 2: 9}, wgrad={-1: 5, 0: 4}, bwd={-1: 10, 0: 8, 1: 11},
                  whole={(-1, -1, -1): 30, (1, 0, 0): 25})
    log = []
    monkeypatch.setattr(autotune, "_time_candidates", scripted_timer(tables, log))
    mlp = FusedMLP(16, 128, dtype=torch.float64)
    x = torch.randn(6, 16, dtype=torch.float64)
    w1, w2, b1, b2 = mlp.fc1.weight, mlp.fc2.weight, mlp.fc1.bias, mlp.fc2.bias

    def plan(rows):
        return autotune.plan_for(x[:rows], w1, w2, b1, b2, torch.float64, "gelu_approx", True, None, False)

    assert plan(6) == (1, 0, 0)  # tuned (the warm-up step)
    tuned = len(log)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert plan(6) == (1, 0, 0)  # the cached plan, not -1
    assert plan(4) == -1  # never tuned: unfused, nothing timed or cached
    assert len(log) == tuned and len(autotune.AUTO_PLANS) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["gelu_approx", "relu"])
def test_auto_plan_gpu(monkeypatch, activation):
    ext = load_ext()
    monkeypatch.setattr(autotune, "AUTO_PLANS", {})
    torch.manual_seed(0)
    mlp = FusedMLP(512, 2048, activation=activation, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(2048, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    mlp(x).sum().backward()
    with torch.no_grad():
        mlp.eval()(x)  # eval mode saves no activation input: a problem of its own
    mlp.train()
    assert sorted(key[-1] for key in autotune.AUTO_PLANS) == [False, True]
    for key, (fwd, bwd, wgrad) in autotune.AUTO_PLANS.items():
        assert key[:4] == (2048, 512, 2048, 512)
        assert -1 <= fwd < ext.max_heuristic_algos and -1 <= bwd < ext.max_heuristic_algos and wgrad in (-1, 0)
        if activation == "relu" and fwd < 0:
            assert bwd < 0
        if not key[-1]:
            assert bwd == -1

    def no_second_tuning(*args):
        raise AssertionError("the plan should be cached")

    monkeypatch.setattr(autotune, "_tune_mlp", no_second_tuning)
    mlp(x).sum().backward()
    with torch.no_grad():
        mlp.eval()(x)


@pytest.mark.gpu
@pytest.mark.parametrize("layer", ["dense", "mlp"])
def test_fused_layers_in_cuda_graph_match_eager(layer):
    """Captured in a CUDA graph (on sm90 and up: bias gradients from bias_grad, the autocast casts
    in one kernel) a step gives eager's gradients: the same GEMMs, fp32 sums in another order."""
    torch.manual_seed(0)
    module = (FusedDense(256, 768, device="cuda") if layer == "dense"
              else FusedMLP(256, 1024, heuristic=0, device="cuda"))
    x = torch.randn(512, 256, device="cuda", requires_grad=True)
    leaves = [x, *module.parameters()]

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
            out = module(x)
        out.float().square().sum().backward()

    step()
    eager = [t.grad.clone() for t in leaves]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for t in leaves:
            t.grad = None
        step()
    torch.cuda.current_stream().wait_stream(side)
    for t in leaves:
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    torch.cuda.synchronize()
    for t, want in zip(leaves, eager):
        assert t.grad.dtype == want.dtype
        scale = want.abs().max().item()
        torch.testing.assert_close(t.grad, want, rtol=1e-4, atol=1e-5 * scale)


@pytest.mark.gpu
@pytest.mark.parametrize("gpu_time", [True, False])
def test_time_candidates_times_work(gpu_time):
    a = torch.randn(2048, 2048, device="cuda")
    times = autotune._time_candidates({"small": lambda: a @ a,
                                       "large": lambda: [a @ a for _ in range(8)]}, gpu_time=gpu_time)
    small, large = times["small"], times["large"]
    assert 0 < small < large
    if gpu_time:  # the 2 ms head start (_HEAD_START_CYCLES) is not timed; one product is < 1 ms
        assert small < 1.0
