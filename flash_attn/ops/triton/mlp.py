"""fc1 -> squared ReLU -> fc2 (Primer's MLP) with the Triton GEMMs of ops.triton.linear:

    forward:  out1, act_input = triton_linear_act(x, w1, b1, "squared_relu", save_act_input)
              out = out1 @ w2.T + b2
    backward: grad_act_input = triton_dgrad_act(grad_out, w2, "squared_relu", act_input)
              (fc2's input gradient and the activation's derivative in one kernel)

The other GEMMs (fc2's forward, the weight gradients, fc1's input gradient) have no epilogue to
fuse and go to torch.matmul (cuBLAS). checkpoint_lvl trades memory for recomputation: 0 saves
act_input and out1; 1 saves act_input and recomputes out1 = act_input.relu()^2; 2 saves
neither and recomputes both with fc1's GEMM.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.amp import custom_bwd, custom_fwd

from flash_attn.ops.activations import sqrelu_fwd
from flash_attn.ops.triton.linear import triton_dgrad_act, triton_linear_act
from flash_attn.utils.autocast import compute_dtype

CHECKPOINT_LVLS = (0, 1, 2)


def fused_dense_sqrelu_dense_ref(x, weight1, bias1, weight2, bias2):
    """The same MLP in plain PyTorch, computed in the inputs' dtype."""
    return F.linear(sqrelu_fwd(F.linear(x, weight1, bias1)), weight2, bias2)


def _fail(name, expected, got):
    raise ValueError(f"FusedDenseSqreluDense: {name} must be {expected}, got {got}")


def _check_checkpoint_lvl(checkpoint_lvl):
    if checkpoint_lvl not in CHECKPOINT_LVLS:
        _fail("checkpoint_lvl", f"one of {CHECKPOINT_LVLS}", repr(checkpoint_lvl))


def _check_args(x, weight1, bias1, weight2, bias2, checkpoint_lvl):
    """Every check, before any kernel runs, with the MLP's names for the arguments."""
    _check_checkpoint_lvl(checkpoint_lvl)
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32) or x.dim() < 1:
        _fail("x", "a float16, bfloat16 or float32 tensor (..., in_features)",
             f"{x.dtype} of shape {tuple(x.shape)}")
    in_features = x.shape[-1]
    hidden = weight1.shape[0] if weight1.dim() == 2 else "hidden_features"
    out_features = weight2.shape[0] if weight2.dim() == 2 else "out_features"
    shapes = {"weight1": (weight1, (hidden, in_features)), "bias1": (bias1, (hidden,)),
              "weight2": (weight2, (out_features, hidden)), "bias2": (bias2, (out_features,))}
    for name, (t, shape) in shapes.items():
        if t is None:
            continue
        if t.dtype != x.dtype or t.device != x.device:
            _fail(name, f"{x.dtype} on {x.device} like x", f"{t.dtype} on {t.device}")
        if tuple(t.shape) != shape:
            _fail(name, f"of shape {shape}", tuple(t.shape))


class FusedDenseSqreluDenseFunc(torch.autograd.Function):
    @staticmethod
    @custom_fwd(device_type="cuda")
    def forward(ctx, x, weight1, bias1, weight2, bias2, checkpoint_lvl=0):
        """x (..., in_features) -> (..., out_features); weight1 (hidden, in), weight2 (out,
        hidden); biases may be None."""
        if torch.is_autocast_enabled(x.device.type):
            dtype = compute_dtype(x.device.type, x.dtype)
            x, weight1, bias1, weight2, bias2 = (t.to(dtype) if t is not None else None
                                                 for t in (x, weight1, bias1, weight2, bias2))
        _check_args(x, weight1, bias1, weight2, bias2, checkpoint_lvl)
        batch_shape = x.shape[:-1]
        x = x.reshape(-1, x.shape[-1])
        if checkpoint_lvl == 2:  # the backward recomputes act_input: not even written here
            out1 = triton_linear_act(x, weight1, bias1, "squared_relu")
            saved = ()
        else:
            out1, act_input = triton_linear_act(x, weight1, bias1, "squared_relu",
                                                save_act_input=True)
            saved = (act_input, out1) if checkpoint_lvl == 0 else (act_input,)
        out = F.linear(out1, weight2, bias2)
        ctx.save_for_backward(x, weight1, bias1, weight2, *saved)
        ctx.checkpoint_lvl, ctx.has_bias2 = checkpoint_lvl, bias2 is not None
        return out.view(*batch_shape, out.shape[-1])

    @staticmethod
    @custom_bwd(device_type="cuda")
    def backward(ctx, grad_output):
        x, weight1, bias1, weight2, *saved = ctx.saved_tensors
        if ctx.checkpoint_lvl == 0:
            act_input, out1 = saved
        elif ctx.checkpoint_lvl == 1:
            (act_input,) = saved
            out1 = sqrelu_fwd(act_input)
        else:
            out1, act_input = triton_linear_act(x, weight1, bias1, "squared_relu",
                                                save_act_input=True)
        batch_shape = grad_output.shape[:-1]
        grad_output = grad_output.reshape(-1, grad_output.shape[-1])
        needs = ctx.needs_input_grad
        grad_weight2 = grad_output.t() @ out1 if needs[3] else None
        grad_bias2 = grad_output.sum(0) if ctx.has_bias2 and needs[4] else None
        grad_input = grad_weight1 = grad_bias1 = None
        if any(needs[:3]):
            grad_act_input = triton_dgrad_act(grad_output, weight2, "squared_relu", act_input)
            if needs[0]:
                grad_input = (grad_act_input @ weight1).view(*batch_shape, x.shape[-1])
            if needs[1]:
                grad_weight1 = grad_act_input.t() @ x
            if bias1 is not None and needs[2]:
                grad_bias1 = grad_act_input.sum(0)
        return grad_input, grad_weight1, grad_bias1, grad_weight2, grad_bias2, None


fused_dense_sqrelu_dense_function = FusedDenseSqreluDenseFunc.apply


class FusedDenseSqreluDense(nn.Module):
    def __init__(self, in_features, hidden_features=None, out_features=None, bias1=True,
                 bias2=True, checkpoint_lvl=0, device=None, dtype=None):
        """fc2(relu(fc1(x))^2) on the Triton kernels (CUDA tensors, or CPU tensors under
        TRITON_INTERPRET=1). hidden_features defaults to 4 * in_features, out_features to
        in_features; checkpoint_lvl (0, 1, 2): more recomputation in the backward, less memory
        (see the module docstring)."""
        _check_checkpoint_lvl(checkpoint_lvl)
        factory_kwargs = {"device": device, "dtype": dtype}
        super().__init__()
        out_features = out_features or in_features
        hidden_features = hidden_features or in_features * 4
        self.checkpoint_lvl = checkpoint_lvl
        self.fc1 = nn.Linear(in_features, hidden_features, bias=bias1, **factory_kwargs)
        self.fc2 = nn.Linear(hidden_features, out_features, bias=bias2, **factory_kwargs)

    def forward(self, x):
        return fused_dense_sqrelu_dense_function(x, self.fc1.weight, self.fc1.bias,
                                                 self.fc2.weight, self.fc2.bias,
                                                 self.checkpoint_lvl)
