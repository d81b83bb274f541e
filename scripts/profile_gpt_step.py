"""Diagnostic (GPU): where benchmark_gpt's "ours + CUDA graph" step spends its time: kernel time by
category and by kernel over three profiled replays, kernels per step, step time minus kernel time,
the FusedMLP plans chosen, a stretch of one step's kernel sequence with grids, and the BGRADB bias
kernels' grids and durations.

    python scripts/profile_gpt_step.py [small] [medium]
"""
import collections
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(1, str(REPO))
import benchmark_gpt  # noqa: E402
from _common import time_ms  # noqa: E402

from flash_attn.ops import fused_dense_autotune  # noqa: E402

# (category, name fragments), first match wins: the Triton kernels' names end in _kernel too.
CATS = [("layernorm", ("layer_norm",)),
        ("xent", ("cross_entropy",)),
        ("attn bwd", ("flash_bwd",)),
        ("attn fwd", ("flash_fwd",)),
        ("bias grad", ("bgrad", "bias_grad")),
        ("adam", ("adam", "multi_tensor")),
        ("gemm", ("gemm", "sm90_xmma", "nvjet", "cutlass", "cublas", "xmma")),
        ("copy/cast", ("copy", "_cast_kernel", "convert")),
        ("elementwise", ("elementwise", "vectorized")),
        ("reduce", ("reduce",)),
        ("embedding", ("embedding", "index")),
        ("memset", ("memset", "fill"))]


def category(kernel_name):
    low = kernel_name.lower()
    for name, fragments in CATS:
        if any(fragment in low for fragment in fragments):
            return name
    return "other"


def kernel_sequence(prof, replays):
    """The kernels of the first profiled replay, in launch order, from the chrome trace."""
    trace = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(trace)
    with open(trace) as f:
        kernels = [e for e in json.load(f)["traceEvents"] if e.get("cat") == "kernel"]
    kernels.sort(key=lambda e: e["ts"])
    return kernels[:len(kernels) // replays]


def run(name, preset, batch, replays=3):
    paths = benchmark_gpt.available_paths()
    model, _, loss_of = benchmark_gpt.build_ours(preset, {}, paths, "cuda", 1024)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True, capturable=True)
    ids = torch.randint(0, benchmark_gpt.VOCAB, (batch, 1024), device="cuda")
    step = benchmark_gpt.capture_step(loss_of, ids, optimizer, 3)
    step_ms = time_ms(step, warmup=100, rep=400)  # about ten 40 ms steps
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            step()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    per_category, per_kernel, calls = (collections.Counter() for _ in range(3))
    for e in events:
        us = e.device_time_total / replays
        per_category[category(e.name)] += us
        per_kernel[e.name] += us
        calls[e.name] += 1
    kernel_ms = sum(per_category.values()) / 1000
    print(f"== {name} b{batch}: graph step {step_ms:.3f} ms ({batch * 1024 / step_ms * 1000:,.0f} "
          f"tok/s), kernel time {kernel_ms:.3f} ms, kernels/step {len(events) / replays:.0f}, "
          f"step - kernels {step_ms - kernel_ms:.3f} ms", flush=True)
    for name_, us in per_category.most_common():
        print(f"  {name_:12s} {us / 1000:8.3f} ms {100 * us / 1000 / kernel_ms:5.1f}%")
    print("  top kernels:")
    for kernel, us in per_kernel.most_common(25):
        print(f"   {us / 1000:7.3f} ms x{calls[kernel] // replays:4d} {category(kernel):10s} {kernel[:110]}")
    print("  FusedMLP plans:", fused_dense_autotune.AUTO_PLANS)
    sequence = kernel_sequence(prof, replays)
    middle = len(sequence) // 2
    print(f"  kernel sequence of one step ({len(sequence)} kernels), positions {middle}..{middle + 60}:")
    for e in sequence[middle:middle + 60]:
        args = e.get("args", {})
        print(f"   {e['dur']:8.1f} us grid {args.get('grid')} block {args.get('block')} {e['name'][:90]}")
    bgrad = collections.Counter((tuple(e["args"].get("grid", ())), round(e["dur"]))
                                for e in sequence if "Bgrad" in e["name"])
    print("  BGRADB bias kernels ((grid), us): count:", sorted(bgrad.items())[:20])


if __name__ == "__main__":
    which = sys.argv[1:] or ["small", "medium"]
    if "small" in which:
        run("gpt2-small", "gpt2-small", 16)
    if "medium" in which:
        run("gpt2-medium", "gpt2-medium", 8)
