"""flash_attn.ops.triton.launch_device: every public Triton op given CPU tensors without the
Triton interpreter says which op and tensor need CUDA (not Triton's "0 active drivers"), and runs
on them with TRITON_INTERPRET=1."""

import pytest
import torch

from flash_attn.layers.rotary import apply_rotary_emb
from flash_attn.losses.cross_entropy import CrossEntropyLoss
from flash_attn.ops.triton.layer_norm import layer_norm_fn, rms_norm_fn
from flash_attn.utils.testing import rotary_tables


def _layer_norm():
    x, weight, bias = torch.randn(3, 16), torch.ones(16), torch.zeros(16)
    return layer_norm_fn(x, weight, bias)


def _rms_norm():
    return rms_norm_fn(torch.randn(3, 16), torch.ones(16), None)


def _cross_entropy():
    return CrossEntropyLoss()(torch.randn(3, 11), torch.tensor([0, 4, 10]))


def _rotary():
    cos, sin = rotary_tables(5, 8, "cpu")
    return apply_rotary_emb(torch.randn(1, 5, 2, 8), cos, sin)


# public op, the launcher's name for it and the argument it names
CPU_CALLS = {
    "layer_norm_fn": (_layer_norm, "layer_norm_fn", "x"),
    "rms_norm_fn": (_rms_norm, "rms_norm_fn", "x"),
    "CrossEntropyLoss": (_cross_entropy, "cross_entropy_loss", "logits"),
    "apply_rotary_emb": (_rotary, "apply_rotary", "x"),
}


@pytest.mark.parametrize("op", list(CPU_CALLS))
def test_cpu_tensor_without_interpreter_names_op_and_argument(op, monkeypatch):
    call, op_name, arg_name = CPU_CALLS[op]
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match=rf"^{op_name}: {arg_name} is a CPU tensor, but its "
                       r"Triton kernel needs a CUDA tensor\..*TRITON_INTERPRET=1 .*interpreter"):
        call()


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="the kernels were built for the GPU: Triton picks the interpreter "
                           "when they are defined, from TRITON_INTERPRET at import")
@pytest.mark.parametrize("op", list(CPU_CALLS))
def test_cpu_tensor_with_interpreter_runs(op, monkeypatch):
    call, _, _ = CPU_CALLS[op]
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert torch.isfinite(call()).all()
