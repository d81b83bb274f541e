"""Where FusedMLP's time goes: for the plain PyTorch MLP and FusedMLP with several heuristic
plans, the do_bench time of a forward + backward step (as benchmarks/benchmark_fused_dense.py
times it), the CPU time per step (50 steps queued without synchronising) and, at GPT-2-medium
8192 tokens, the per-kernel CUDA time (torch.profiler). A diagnostic for the GPU machine:

    python scripts/profile_fused_mlp.py
"""
import functools
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
from _common import time_ms  # noqa: E402
from benchmark_fused_dense import PlainMLP  # noqa: E402  (the peer the benchmark times)

import flash_attn.ops.fused_dense as fd  # noqa: E402
from flash_attn.ops.fused_dense import FusedMLP  # noqa: E402

SHAPES = [(8192, 1024, 4096), (16384, 1024, 4096), (8192, 4096, 11008)]  # (tokens, d, hidden)
HEURISTICS = ["auto", -1, 0, (-1, -1, -1), (0, 0, -1), (0, -1, -1), (-1, 0, -1), (4, 4, -1)]
PROFILED_SHAPE = (8192, 1024, 4096)


def step(module, x, grad):
    x.grad = None
    for p in module.parameters():
        p.grad = None
    module(x).backward(grad)


def cpu_and_wall_ms(fn, steps=50):
    """(CPU ms per step while queueing, wall ms per step including the GPU draining)."""
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    queued = time.perf_counter()
    torch.cuda.synchronize()
    done = time.perf_counter()
    return (queued - start) / steps * 1e3, (done - start) / steps * 1e3


def main():
    device, dtype = "cuda", torch.bfloat16
    for tokens, d, hidden in SHAPES:
        torch.manual_seed(0)
        x = torch.randn(tokens, d, device=device, dtype=dtype, requires_grad=True)
        grad = torch.randn(tokens, d, device=device, dtype=dtype)
        plain = PlainMLP(d, hidden, device=device, dtype=dtype)
        variants = {"plain": plain}
        for heuristic in HEURISTICS:
            mlp = FusedMLP(d, hidden, heuristic=heuristic, device=device, dtype=dtype)
            mlp.load_state_dict(plain.state_dict())
            variants[f"fused {heuristic}"] = mlp
        print(f"\n=== tokens {tokens} d {d} hidden {hidden}")
        for name, module in variants.items():
            fn = functools.partial(step, module, x, grad)
            fn()  # "auto" measures its candidates here, once
            torch.cuda.synchronize()
            ms = time_ms(fn)
            cpu, wall = cpu_and_wall_ms(fn)
            print(f"{name:24s} do_bench {ms:.3f} ms | cpu/step {cpu:.3f} ms | wall/step {wall:.3f} ms")
        if (tokens, d, hidden) == PROFILED_SHAPE:
            for name in ["plain", "fused -1", "fused 0"]:
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    for _ in range(3):
                        step(variants[name], x, grad)
                    torch.cuda.synchronize()
                print(f"--- {name}, 3 steps")
                print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=70))
        print("auto plans:", {key[:4]: plan for key, plan in fd._AUTO_PLANS.items()})


if __name__ == "__main__":
    main()
