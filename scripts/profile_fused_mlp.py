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
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
from _common import time_ms  # noqa: E402

import flash_attn.ops.fused_dense as fd  # noqa: E402
from flash_attn.ops.fused_dense import FusedMLP  # noqa: E402

class PlainMLP(nn.Module):
    def __init__(self, d, hidden, **kw):
        super().__init__(); self.fc1, self.fc2 = nn.Linear(d, hidden, **kw), nn.Linear(hidden, d, **kw)
    def forward(self, x): return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))

dev, dt = "cuda", torch.bfloat16
for tokens, d, hidden in [(8192, 1024, 4096), (16384, 1024, 4096), (8192, 4096, 11008)]:
    torch.manual_seed(0)
    x = torch.randn(tokens, d, device=dev, dtype=dt, requires_grad=True)
    g = torch.randn(tokens, d, device=dev, dtype=dt)
    plain = PlainMLP(d, hidden, device=dev, dtype=dt)
    variants = {"plain": plain}
    for h in ["auto", -1, 0, (-1, -1, -1), (0, 0, -1), (0, -1, -1), (-1, 0, -1), (4, 4, -1)]:
        m = FusedMLP(d, hidden, heuristic=h, device=dev, dtype=dt)
        m.load_state_dict(plain.state_dict()); variants[f"fused {h}"] = m
    def step(module):
        x.grad = None
        for p in module.parameters(): p.grad = None
        module(x).backward(g)
    print(f"\n=== tokens {tokens} d {d} hidden {hidden}")
    for name, m in variants.items():
        step(m); torch.cuda.synchronize()
        t = time_ms(functools.partial(step, m))
        t0 = time.perf_counter()
        for _ in range(50): step(m)
        t1 = time.perf_counter(); torch.cuda.synchronize(); t2 = time.perf_counter()
        print(f"{name:24s} do_bench {t:.3f} ms | cpu/step {(t1-t0)/50*1e3:.3f} ms | wall/step {(t2-t0)/50*1e3:.3f} ms")
    if tokens == 8192 and d == 1024:
        for name in ["plain", "fused -1", "fused 0"]:
            m = variants[name]
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(3): step(m)
                torch.cuda.synchronize()
            print(f"--- {name}")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=70))
    print("auto plans:", {k[:4]: v for k, v in fd._AUTO_PLANS.items()})
