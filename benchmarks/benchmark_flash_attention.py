"""Attention TFLOP/s, forward / backward / forward+backward: ours vs PyTorch SDPA's flash
(flash-attn 2's kernels) and cuDNN backends, measured in the same run; plus peak extra memory.

16k tokens per batch, hidden 2048 (heads = 2048 / d), as ../shared/anchors measured.
Usage: python benchmarks/benchmark_flash_attention.py [--dtypes bf16,fp16] [--dims 64,128,256]
                                                      [--passes fwd,bwd,fwd_bwd]
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import report, save_plot, time_ms  # noqa: E402

from flash_attn import flash_attn_func  # noqa: E402
from flash_attn._native import load_extension  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
PEERS = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}
# Backward FLOPs are 2.5x the forward's (five matmuls of the forward's size instead of two).
FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}


def has_backward():
    return hasattr(load_extension("flash_attn_2_cuda"), "bwd")


def attention_flops(batch, seqlen, heads, d, causal):
    return 4 * batch * seqlen * seqlen * heads * d // (2 if causal else 1)


def attention_fns(batch, seqlen, heads, d, dtype, causal, requires_grad):
    """{method: () -> out} over the same random inputs, each in its native layout."""
    q, k, v = (torch.randn(batch, seqlen, heads, d, device="cuda", dtype=dtype, requires_grad=requires_grad)
               for _ in range(3))
    fns = {"ours": ((q, k, v), lambda: flash_attn_func(q, k, v, causal=causal))}
    # SDPA takes (b, h, s, d); contiguous in that layout so no backend copies its inputs.
    qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_(requires_grad) for x in (q, k, v))
    for name, backend in PEERS.items():
        def peer(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
        fns[name] = ((qt, kt, vt), peer)
    return fns


def time_pass(inputs, fn, kind):
    if kind == "fwd":
        return time_ms(fn)
    if kind == "bwd":
        out = fn()
        grad = torch.randn_like(out)
        return time_ms(lambda: torch.autograd.grad(out, inputs, grad, retain_graph=True))
    out = fn()
    grad = torch.randn_like(out)
    return time_ms(lambda: torch.autograd.grad(fn(), inputs, grad))


def run_speed(dtypes, dims, seqlens, passes):
    rows, series = [], {}
    for kind in passes:
        for dtype_name in dtypes:
            for d in dims:
                for causal in (False, True):
                    heads = 2048 // d
                    for seqlen in seqlens:
                        batch = max(16384 // seqlen, 1)
                        flops = attention_flops(batch, seqlen, heads, d, causal) * FLOP_FACTOR[kind]
                        tflops = {}
                        fns = attention_fns(batch, seqlen, heads, d, DTYPES[dtype_name], causal, kind != "fwd")
                        for name, (inputs, fn) in fns.items():
                            try:
                                tflops[name] = flops / time_pass(inputs, fn, kind) / 1e9
                            except RuntimeError as error:  # a peer backend may refuse a shape
                                print(f"{name} failed at {kind} d={d} s={seqlen}: {str(error)[:100]}")
                                tflops[name] = float("nan")
                        rows.append([kind, dtype_name, d, causal, seqlen, batch, heads, tflops["ours"],
                                     tflops["sdpa_flash"], tflops["sdpa_cudnn"],
                                     tflops["ours"] / tflops["sdpa_flash"],
                                     tflops["ours"] / tflops["sdpa_cudnn"]])
                        print(rows[-1], flush=True)
                        for name, value in tflops.items():
                            key = f"{kind} {name} {dtype_name} d{d}{' causal' if causal else ''}"
                            series.setdefault(key, ([], []))
                            series[key][0].append(seqlen)
                            series[key][1].append(value)
    headers = ["pass", "dtype", "d", "causal", "seqlen", "batch", "heads", "ours TFLOP/s",
               "SDPA flash TFLOP/s", "SDPA cuDNN TFLOP/s", "ours / flash", "ours / cuDNN"]
    report(f"Attention {'/'.join(passes)} (flash_attn_func vs SDPA flash and cuDNN, same run)", headers,
           rows, notes="FLOPs: 4*b*s*s*h*d per forward (halved for causal), backward 2.5x; "
                       "16k tokens per batch, hidden 2048.")
    for kind in passes:
        plotted = {k[len(kind) + 1:]: v for k, v in series.items() if k.startswith(kind + " ") and "bf16" in k}
        save_plot(f"attention_{kind}.png", f"Attention {kind}, bf16, 16k tokens/batch, hidden 2048",
                  "sequence length", "TFLOP/s", plotted, xticks=list(seqlens))
        bad = [r for r in rows if r[0] == kind and r[1] == "bf16" and r[2] in (64, 128) and r[4] >= 1024
               and r[10] < 0.9]
        print(f"done-when check ({kind}, bf16, d 64/128, s >= 1024: ours >= 0.9x SDPA flash): "
              f"{'PASS' if not bad else 'FAIL on ' + str([(r[2], r[3], r[4]) for r in bad])}")
    return rows


def peak_extra_mib(fn, inputs, backward):
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    if backward:
        torch.autograd.grad(out, inputs, torch.ones_like(out))
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def run_memory(backward, seqlens=(4096, 16384, 65536), heads=16, d=128):
    methods = {"ours": None, "sdpa_flash": SDPBackend.FLASH_ATTENTION}
    if backward:
        methods["sdpa_math"] = SDPBackend.MATH
    rows = []
    for seqlen in seqlens:
        q, k, v = (torch.randn(1, seqlen, heads, d, device="cuda", dtype=torch.bfloat16,
                               requires_grad=backward) for _ in range(3))
        qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_(backward) for x in (q, k, v))
        row = [seqlen]
        for name, backend in methods.items():
            if backend is None:
                fn, inputs = (lambda: flash_attn_func(q, k, v, causal=True)), (q, k, v)
            else:
                def fn(backend=backend):
                    with sdpa_kernel(backend):
                        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
                inputs = (qt, kt, vt)
            try:
                row.append(peak_extra_mib(fn, inputs, backward))
            except torch.OutOfMemoryError:
                row.append(float("nan"))  # the math backend materialises seqlen^2 scores
        rows.append(row)
        del q, k, v, qt, kt, vt
        torch.cuda.empty_cache()
    what = "forward + backward" if backward else "forward"
    report(f"Attention {what} peak extra memory, MiB (b=1, h=16, d=128, causal, bf16)",
           ["seqlen"] + list(methods), rows,
           notes="nan: out of memory. Ours keeps nothing of size seqlen^2: linear in the sequence length.")
    per_token = [r[1] / r[0] for r in rows]
    linear = max(per_token) <= 1.1 * min(per_token)
    print(f"{what} memory of ours linear in s: {'PASS' if linear else 'FAIL'} (MiB per token {per_token})")


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dtypes", default="bf16,fp16")
    parser.add_argument("--dims", default="64,128,256")
    parser.add_argument("--seqlens", default=",".join(map(str, SEQLENS)))
    parser.add_argument("--passes", default="fwd,bwd,fwd_bwd")
    args = parser.parse_args()
    passes = args.passes.split(",")
    backward = any(p != "fwd" for p in passes)
    if backward and not has_backward():
        print("this build has no backward kernels: forward only")
        passes, backward = ["fwd"], False
    run_speed(args.dtypes.split(","), [int(d) for d in args.dims.split(",")],
              [int(s) for s in args.seqlens.split(",")], passes)
    run_memory(backward=False)
    if backward:
        run_memory(backward=True)


if __name__ == "__main__":
    main()
