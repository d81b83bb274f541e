"""Triton GEMM + bias + squared ReLU, and FusedDenseSqreluDense, vs the same MLP in plain PyTorch
(eager and torch.compile), same run, bf16 and fp16.

MLP shapes of GPT-2 medium (1024 -> 4096), GPT-2 large (1280 -> 5120) and Llama-7B (4096 -> 11008,
run as a squared-ReLU MLP) at 8k and 16k tokens:
1. fc1 forward: triton_linear_act(x, w1, b1, "squared_relu", save_act_input=True) vs F.linear then
   relu^2 (eager; torch.compile of the same), and F.linear alone (cuBLAS's GEMM with bias: what
   the fused epilogue is measured against).
2. MLP forward and forward+backward: FusedDenseSqreluDense (checkpoint_lvl 0) vs the plain
   PyTorch MLP (nn.Linear -> relu^2 -> nn.Linear), eager and under torch.compile.
Done-when checks, printed at the end: FusedDenseSqreluDense fwd+bwd >= 1.0x the eager MLP;
triton_linear_act within 10% of F.linear alone (the epilogue nearly free).
Usage: python benchmarks/benchmark_triton_mlp.py [--smoke] [--no-compile] [--dtypes bf16,fp16]
(--smoke: tiny shapes on CPU, fp32, Triton in its interpreter, no torch.compile, to check the
script itself)
"""

import functools
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import parse_args, report, save_plot, time_ms, wall_ms  # noqa: E402

# flash_attn's Triton modules define kernels, so they are imported in the functions below,
# after parse_args has turned Triton's interpreter on for --smoke.

MODELS = {"gpt2-medium": (1024, 4096), "gpt2-large": (1280, 5120), "llama-7b": (4096, 11008)}
TOKENS = (8192, 16384)
MLP_TARGET = 1.0  # FusedDenseSqreluDense fwd+bwd speedup over the eager MLP
EPILOGUE_SLACK = 1.10  # triton_linear_act time / F.linear time


class PlainSqreluMLP(nn.Module):
    def __init__(self, d, hidden, **kw):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, hidden, **kw), nn.Linear(hidden, d, **kw)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)).square())


def _linear_sqrelu(x, w, b):
    pre = F.linear(x, w, b)
    return F.relu(pre).square(), pre


def bench_fc1(timer, tokens, d, hidden, device, dtype, compile_peer):
    from flash_attn.ops.triton.linear import triton_linear_act

    x = torch.randn(tokens, d, device=device, dtype=dtype)
    w = torch.randn(hidden, d, device=device, dtype=dtype) * d ** -0.5
    b = torch.randn(hidden, device=device, dtype=dtype)
    # Correctness guard: a fast wrong kernel must not pass.
    ours_out, ours_pre = triton_linear_act(x, w, b, "squared_relu", save_act_input=True)
    ref_out, ref_pre = _linear_sqrelu(x.float(), w.float(), b.float())
    torch.testing.assert_close(ours_pre.float(), ref_pre, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(ours_out.float(), ref_out, rtol=2e-2, atol=5e-2)
    times = {
        "F.linear": timer(lambda: F.linear(x, w, b)),
        "eager": timer(lambda: _linear_sqrelu(x, w, b)),
        "ours": timer(lambda: triton_linear_act(x, w, b, "squared_relu", save_act_input=True)),
        "compiled": float("nan"),
    }
    if compile_peer:
        compiled = torch.compile(_linear_sqrelu, dynamic=False)
        times["compiled"] = timer(lambda: compiled(x, w, b))
    return times


def bench_mlp(timer, tokens, d, hidden, device, dtype, compile_peer):
    from flash_attn.ops.triton.mlp import FusedDenseSqreluDense

    torch.manual_seed(0)
    x = torch.randn(tokens, d, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn(tokens, d, device=device, dtype=dtype)
    plain = PlainSqreluMLP(d, hidden, device=device, dtype=dtype)
    ours = FusedDenseSqreluDense(d, hidden, device=device, dtype=dtype)
    ours.load_state_dict(plain.state_dict())
    variants = {"eager": plain, "ours": ours}
    if compile_peer:
        variants["compiled"] = torch.compile(plain, dynamic=False)
    torch.testing.assert_close(ours(x).float(), plain(x).float(), rtol=3e-2, atol=3e-2)

    def step(module):
        x.grad = None
        for p in module.parameters():
            p.grad = None
        module(x).backward(grad)

    fwd, fwd_bwd = {}, {}
    with torch.no_grad():
        for name, module in variants.items():
            fwd[name] = timer(functools.partial(module, x))
    for name, module in variants.items():
        fwd_bwd[name] = timer(functools.partial(step, module))
    for times in (fwd, fwd_bwd):
        times.setdefault("compiled", float("nan"))
    return fwd, fwd_bwd


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _add_options(parser):
    parser.add_argument("--dtypes", default="bf16,fp16",
                        help="comma-separated, of bf16 and fp16 (default both)")


def main():
    args = parse_args(__doc__, compile_option=True, add_options=_add_options)
    if args.smoke:
        device, timer, dtypes = "cpu", wall_ms, (torch.float32,)
        models, tokens_list = {"tiny": (32, 128)}, (64, 128)
    else:
        device, timer = "cuda", time_ms
        dtypes = tuple(DTYPES[name] for name in args.dtypes.split(","))
        models, tokens_list = MODELS, TOKENS
        # One specialisation per shape: lift dynamo's default limit of 8.
        for knob in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, knob):
                setattr(torch._dynamo.config, knob, 64)
    compile_peer = not args.no_compile and not args.smoke

    fc1_rows, mlp_rows, checks = [], [], {"mlp": [], "epilogue": []}
    series = {}
    for dtype in dtypes:
        dname = str(dtype).removeprefix("torch.")
        for model, (d, hidden) in models.items():
            for tokens in tokens_list:
                shape = f"{model} {tokens}x{d}->{hidden}"
                print(f"{dname} {shape} ...", flush=True)
                t = bench_fc1(timer, tokens, d, hidden, device, dtype, compile_peer)
                tflop = 2 * tokens * d * hidden / 1e9
                fc1_rows.append([dname, shape, t["F.linear"], t["eager"], t["compiled"], t["ours"],
                                 tflop / t["ours"], t["eager"] / t["ours"],
                                 t["compiled"] / t["ours"], t["ours"] / t["F.linear"]])
                checks["epilogue"].append((f"{dname} {shape}", t["ours"] / t["F.linear"]))

                fwd, fwd_bwd = bench_mlp(timer, tokens, d, hidden, device, dtype, compile_peer)
                mlp_tflop = 12 * tokens * d * hidden / 1e9
                mlp_rows.append([dname, shape, fwd["eager"], fwd["compiled"], fwd["ours"],
                                 fwd["eager"] / fwd["ours"], fwd_bwd["eager"],
                                 fwd_bwd["compiled"], fwd_bwd["ours"], mlp_tflop / fwd_bwd["ours"],
                                 fwd_bwd["eager"] / fwd_bwd["ours"],
                                 fwd_bwd["compiled"] / fwd_bwd["ours"]])
                checks["mlp"].append((f"{dname} {shape}", fwd_bwd["eager"] / fwd_bwd["ours"]))
                for peer in ("eager", "compiled"):
                    label = f"{dname} {model} fwd+bwd vs {peer}"
                    xs, ys = series.setdefault(label, ([], []))
                    xs.append(tokens)
                    ys.append(fwd_bwd[peer] / fwd_bwd["ours"])
                if device == "cuda":
                    torch.cuda.empty_cache()

    report("triton_mlp: fc1 GEMM + bias + squared ReLU forward (ms)",
           ["dtype", "shape", "F.linear", "eager linear+relu^2", "compiled linear+relu^2", "ours",
            "ours TFLOP/s", "eager/ours", "compiled/ours", "ours/F.linear"],
           fc1_rows, notes="ours = triton_linear_act(..., 'squared_relu', save_act_input=True), "
                           "which also writes the pre-activation (as do the eager and compiled "
                           "peers, which return it); F.linear alone is the GEMM + bias floor.")
    report("triton_mlp: FusedDenseSqreluDense vs the PyTorch MLP (ms)",
           ["dtype", "shape", "fwd eager", "fwd compiled", "fwd ours", "fwd eager/ours",
            "fwd+bwd eager", "fwd+bwd compiled", "fwd+bwd ours", "fwd+bwd ours TFLOP/s",
            "fwd+bwd eager/ours", "fwd+bwd compiled/ours"],
           mlp_rows, notes="ratio = peer time / our time (> 1: ours faster); FLOPs of fwd+bwd "
                           "12 * tokens * d * hidden. checkpoint_lvl 0.")
    save_plot("triton_mlp.png", "FusedDenseSqreluDense fwd+bwd: speedup over the PyTorch MLP",
              "tokens", "speedup (x)", series, xticks=list(tokens_list))

    print("\n## Done-when checks")
    worst_mlp = min(checks["mlp"], key=lambda c: c[1])
    print(f"[{'PASS' if worst_mlp[1] >= MLP_TARGET else 'FAIL'}] FusedDenseSqreluDense fwd+bwd "
          f">= {MLP_TARGET}x the eager MLP: "
          + ", ".join(f"{s} {r:.3f}x" for s, r in checks["mlp"]) + f" (worst {worst_mlp[1]:.3f}x)")
    worst_epi = max(checks["epilogue"], key=lambda c: c[1])
    print(f"[{'PASS' if worst_epi[1] <= EPILOGUE_SLACK else 'FAIL'}] triton_linear_act within "
          f"{EPILOGUE_SLACK - 1:.0%} of F.linear alone: time ratios "
          + ", ".join(f"{s} {r:.3f}" for s, r in checks["epilogue"])
          + f" (worst {worst_epi[1]:.3f})")


if __name__ == "__main__":
    main()
