"""An error raised in C++ reaches Python as RuntimeError, never as a crash.

Each case calls an extension directly (past the Python checks) with an argument only the binding
rejects, in a fresh interpreter: an extension built with a host compiler ABI-incompatible with
PyTorch dies there with SIGSEGV instead (csrc/host_compiler.py says why the build avoids that).
"""

import subprocess
import sys
import textwrap

import pytest
import torch

from flash_attn._native import extension_available

CASES = {
    "flash_attn_2_cuda": """
        q = torch.randn(1, 8, 2, 64, device=device, dtype=torch.float16)
        flash_attn_2_cuda.fwd(q, q, q, None, None, 0.0, 0.125, False, -2, 0, 0.0, False, None)
    """,
    "fused_dense_lib": """
        x = torch.randn(4, 64, device=device, dtype=torch.float16)
        w = torch.randn(32, 48, device=device, dtype=torch.float16)
        fused_dense_lib.linear_act_forward(x, w, None, True, False, 0)
    """,
    "dropout_layer_norm": """
        x = torch.randn(4, 64, device=device, dtype=torch.float16)
        gamma = torch.ones(32, device=device, dtype=torch.float16)
        dropout_layer_norm.dropout_add_ln_fwd(x, None, gamma, None, None, None, None, None, 0.0,
                                              1e-5, 1.0, 0, None, False, False)
    """,
}


def run_case(extension, device):
    body = textwrap.indent(textwrap.dedent(CASES[extension]), "    ")
    code = (f"import sys, torch, {extension}\ndevice = {device!r}\ntry:\n{body}\n"
            "except RuntimeError as error:\n"
            "    print('RuntimeError:', error)\n    sys.exit(0)\n"
            "print('no error raised')\nsys.exit(1)\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("device", ["cuda", "cpu"])
@pytest.mark.parametrize("extension", list(CASES))
def test_cpp_error_raises_runtime_error_not_a_signal(extension, device):
    if not extension_available(extension):
        pytest.skip(f"{extension} is not built here")
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    result = run_case(extension, device)
    assert result.returncode >= 0, (
        f"{extension} killed by signal {-result.returncode} on a C++ error\n{result.stderr}")
    assert result.returncode == 0 and "RuntimeError:" in result.stdout, result.stdout + result.stderr
