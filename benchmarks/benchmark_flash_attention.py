"""Attention forward TFLOP/s: ours vs PyTorch SDPA's flash (flash-attn 2's kernels) and cuDNN
backends, measured in the same run; plus the peak extra memory of ours as the sequence grows.

16k tokens per batch, hidden 2048 (heads = 2048 / d), as ../shared/anchors measured.
Usage: python benchmarks/benchmark_flash_attention.py [--dtypes bf16,fp16] [--dims 64,128,256]
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

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
PEERS = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}


def attention_flops(batch, seqlen, heads, d, causal):
    return 4 * batch * seqlen * seqlen * heads * d // (2 if causal else 1)


def forward_fns(batch, seqlen, heads, d, dtype, causal):
    q, k, v = (torch.randn(batch, seqlen, heads, d, device="cuda", dtype=dtype) for _ in range(3))
    fns = {"ours": lambda: flash_attn_func(q, k, v, causal=causal)}
    # SDPA takes (b, h, s, d); contiguous in that layout so no backend copies its inputs.
    qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    for name, backend in PEERS.items():
        def peer(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
        fns[name] = peer
    return fns


def run_speed(dtypes, dims, seqlens):
    rows, series = [], {}
    for dtype_name in dtypes:
        for d in dims:
            for causal in (False, True):
                heads = 2048 // d
                for seqlen in seqlens:
                    batch = max(16384 // seqlen, 1)
                    flops = attention_flops(batch, seqlen, heads, d, causal)
                    tflops = {}
                    for name, fn in forward_fns(batch, seqlen, heads, d, DTYPES[dtype_name], causal).items():
                        try:
                            tflops[name] = flops / time_ms(fn) / 1e9
                        except RuntimeError as error:  # a peer backend may refuse a shape
                            print(f"{name} failed at d={d} s={seqlen}: {str(error)[:100]}")
                            tflops[name] = float("nan")
                    rows.append([dtype_name, d, causal, seqlen, batch, heads, tflops["ours"],
                                 tflops["sdpa_flash"], tflops["sdpa_cudnn"],
                                 tflops["ours"] / tflops["sdpa_flash"],
                                 tflops["ours"] / tflops["sdpa_cudnn"]])
                    print(rows[-1], flush=True)
                    for name, value in tflops.items():
                        key = f"{name} {dtype_name} d{d}{' causal' if causal else ''}"
                        series.setdefault(key, ([], []))
                        series[key][0].append(seqlen)
                        series[key][1].append(value)
    headers = ["dtype", "d", "causal", "seqlen", "batch", "heads", "ours TFLOP/s",
               "SDPA flash TFLOP/s", "SDPA cuDNN TFLOP/s", "ours / flash", "ours / cuDNN"]
    report("Attention forward (flash_attn_func vs SDPA flash and cuDNN, same run)", headers, rows,
           notes="FLOPs: 4*b*s*s*h*d, halved for causal; 16k tokens per batch, hidden 2048.")
    plotted = {k: v for k, v in series.items() if "bf16" in k}
    save_plot("attention_forward.png", "Attention forward, bf16, 16k tokens/batch, hidden 2048",
              "sequence length", "TFLOP/s", plotted, xticks=list(seqlens))
    bad = [r for r in rows if r[0] == "bf16" and r[1] in (64, 128) and r[3] >= 1024 and r[9] < 0.9]
    print(f"\ndone-when check (bf16, d 64/128, s >= 1024: ours >= 0.9x SDPA flash): "
          f"{'PASS' if not bad else 'FAIL on ' + str([(r[1], r[2], r[3]) for r in bad])}")
    return rows


def run_memory(seqlens=(4096, 16384, 65536), heads=16, d=128):
    rows = []
    for seqlen in seqlens:
        q, k, v = (torch.randn(1, seqlen, heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = flash_attn_func(q, k, v, causal=True)
        torch.cuda.synchronize()
        extra = (torch.cuda.max_memory_allocated() - base) / 2**20
        rows.append([seqlen, extra, extra / (seqlen / 1024)])
        del q, k, v, out
        torch.cuda.empty_cache()
    report("Attention forward peak extra memory (ours, b=1, h=16, d=128, causal, bf16)",
           ["seqlen", "extra MiB", "MiB per 1k tokens"], rows,
           notes="Output + log-sum-exp only: linear in the sequence length.")
    per_k = [r[2] for r in rows]
    linear = max(per_k) <= 1.05 * min(per_k)
    print(f"memory linear in s: {'PASS' if linear else 'FAIL'} ({per_k})")
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dtypes", default="bf16,fp16")
    parser.add_argument("--dims", default="64,128,256")
    parser.add_argument("--seqlens", default=",".join(map(str, SEQLENS)))
    args = parser.parse_args()
    run_speed(args.dtypes.split(","), [int(d) for d in args.dims.split(",")],
              [int(s) for s in args.seqlens.split(",")])
    run_memory()


if __name__ == "__main__":
    main()
