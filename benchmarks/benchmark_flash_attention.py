"""Attention TFLOP/s, forward / backward / forward+backward: ours vs PyTorch SDPA's flash
(flash-attn 2's kernels) and cuDNN backends, measured in the same run; plus peak extra memory.

16k tokens per batch, hidden 2048 (heads = 2048 / d), as ../shared/anchors measured.
Usage: python benchmarks/benchmark_flash_attention.py [--dtypes bf16,fp16] [--dims 64,128,256]
                                                      [--seqlens 512,...] [--passes fwd,bwd,fwd_bwd]
                                                      [--smoke]
--smoke: tiny shapes on CPU, to check the script itself; "ours" is then a stand-in (SDPA's math
backend), since our kernels need CUDA.
"""

import functools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import note_stand_in, parse_args, report, save_plot, time_ms, wall_ms  # noqa: E402

from flash_attn import flash_attn_func  # noqa: E402
from flash_attn._native import load_extension  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
TOKENS, HIDDEN = 16384, 2048  # per batch: batch = TOKENS / seqlen, heads = HIDDEN / d
PEERS = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}
# Backward FLOPs are 2.5x the forward's (five matmuls of the forward's size instead of two).
FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}


def has_backward():
    return hasattr(load_extension("flash_attn_2_cuda"), "bwd")


def attention_flops(batch, seqlen, heads, d, causal):
    return 4 * batch * seqlen * seqlen * heads * d // (2 if causal else 1)


def sdpa_math_stand_in(q, k, v, causal=False):
    """--smoke only: flash_attn_func's layout and result from SDPA's math backend, on CPU."""
    with sdpa_kernel(SDPBackend.MATH):
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=causal)
    return out.transpose(1, 2)


def attention_fns(ours, batch, seqlen, heads, d, dtype, causal, requires_grad, device):
    """{method: () -> out} over the same random inputs, each in its native layout."""
    q, k, v = (torch.randn(batch, seqlen, heads, d, device=device, dtype=dtype, requires_grad=requires_grad)
               for _ in range(3))
    fns = {"ours": ((q, k, v), lambda: ours(q, k, v, causal=causal))}
    # SDPA takes (b, h, s, d); contiguous in that layout so no backend copies its inputs.
    qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_(requires_grad) for x in (q, k, v))
    for name, backend in PEERS.items():
        def peer(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
        fns[name] = ((qt, kt, vt), peer)
    return fns


def time_pass(inputs, fn, kind, timer):
    if kind == "fwd":
        return timer(fn)
    if kind == "bwd":
        out = fn()
        grad = torch.randn_like(out)
        return timer(lambda: torch.autograd.grad(out, inputs, grad, retain_graph=True))
    out = fn()
    grad = torch.randn_like(out)
    return timer(lambda: torch.autograd.grad(fn(), inputs, grad))


def run_speed(ours, dtypes, dims, seqlens, passes, device, timer, tokens=TOKENS, hidden=HIDDEN):
    rows, series = [], {}
    for kind in passes:
        for dtype_name in dtypes:
            for d in dims:
                for causal in (False, True):
                    heads = hidden // d
                    for seqlen in seqlens:
                        batch = max(tokens // seqlen, 1)
                        flops = attention_flops(batch, seqlen, heads, d, causal) * FLOP_FACTOR[kind]
                        tflops = {}
                        fns = attention_fns(ours, batch, seqlen, heads, d, DTYPES[dtype_name], causal,
                                            kind != "fwd", device)
                        for name, (inputs, fn) in fns.items():
                            try:
                                tflops[name] = flops / time_pass(inputs, fn, kind, timer) / 1e9
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
                       f"{tokens // 1024}k tokens per batch, hidden {hidden}.")
    for kind in passes:
        plotted = {k[len(kind) + 1:]: v for k, v in series.items() if k.startswith(kind + " ") and "bf16" in k}
        save_plot(f"attention_{kind}.png",
                  f"Attention {kind}, bf16, {tokens // 1024}k tokens/batch, hidden {hidden}",
                  "sequence length", "TFLOP/s", plotted, xticks=list(seqlens))
        bad = [r for r in rows if r[0] == kind and r[1] == "bf16" and r[2] in (64, 128) and r[4] >= 1024
               and r[10] < 0.9]
        print(f"done-when check ({kind}, bf16, d 64/128, s >= 1024: ours >= 0.9x SDPA flash): "
              f"{'PASS' if not bad else 'FAIL on ' + str([(r[2], r[3], r[4]) for r in bad])}")
    return rows


def peak_extra_mib(fn, inputs, backward):
    if not inputs[0].is_cuda:
        return float("nan")  # --smoke: CUDA's allocator statistics are the measurement
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    if backward:
        torch.autograd.grad(out, inputs, torch.ones_like(out))
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def run_memory(ours, backward, device, seqlens=(4096, 16384, 65536), heads=16, d=128):
    methods = {"ours": None, "sdpa_flash": SDPBackend.FLASH_ATTENTION}
    if backward:
        methods["sdpa_math"] = SDPBackend.MATH
    rows = []
    for seqlen in seqlens:
        print(f"memory, {'forward + backward' if backward else 'forward'}, seqlen {seqlen} ...",
              flush=True)
        q, k, v = (torch.randn(1, seqlen, heads, d, device=device, dtype=torch.bfloat16,
                               requires_grad=backward) for _ in range(3))
        qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_(backward) for x in (q, k, v))
        row = [seqlen]
        for name, backend in methods.items():
            if backend is None:
                fn, inputs = (lambda: ours(q, k, v, causal=True)), (q, k, v)
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
        if device == "cuda":
            torch.cuda.empty_cache()
    what = "forward + backward" if backward else "forward"
    report(f"Attention {what} peak extra memory, MiB (b=1, h={heads}, d={d}, causal, bf16)",
           ["seqlen"] + list(methods), rows,
           notes="nan: out of memory. Ours keeps nothing of size seqlen^2: linear in the sequence length.")
    if device != "cuda":
        print(f"{what} memory: not measured on CPU (CUDA's allocator statistics are the measurement)")
        return
    per_token = [r[1] / r[0] for r in rows]
    linear = max(per_token) <= 1.1 * min(per_token)
    print(f"{what} memory of ours linear in s: {'PASS' if linear else 'FAIL'} (MiB per token {per_token})")


GPU_DEFAULTS = dict(dtypes="bf16,fp16", dims="64,128,256", seqlens=",".join(map(str, SEQLENS)),
                    passes="fwd,bwd,fwd_bwd")
SMOKE_DEFAULTS = dict(dtypes="bf16", dims="16", seqlens="32,64", passes="fwd,bwd,fwd_bwd")


def add_options(parser):
    # No argparse defaults: a --smoke run has its own (SMOKE_DEFAULTS).
    for name, default in GPU_DEFAULTS.items():
        parser.add_argument(f"--{name}", help=f"comma-separated (default {default})")


def main():
    args = parse_args(__doc__, add_options=add_options)
    options = {name: getattr(args, name) or default
               for name, default in (SMOKE_DEFAULTS if args.smoke else GPU_DEFAULTS).items()}
    passes = options["passes"].split(",")
    backward = any(p != "fwd" for p in passes)
    if args.smoke:
        note_stand_in("'ours' is SDPA's math backend on CPU (our attention kernels need CUDA); "
                      "the SDPA peers run their CPU kernels where they have one")
        ours, device, timer = sdpa_math_stand_in, "cpu", functools.partial(wall_ms, reps=2)
        shape = dict(tokens=1024, hidden=32)
        memory_shape = dict(seqlens=(32, 64), heads=2, d=16)
    else:
        ours, device, timer, shape, memory_shape = flash_attn_func, "cuda", time_ms, {}, {}
        if backward and not has_backward():
            print("this build has no backward kernels: forward only")
            passes, backward = ["fwd"], False
    run_speed(ours, options["dtypes"].split(","), [int(d) for d in options["dims"].split(",")],
              [int(s) for s in options["seqlens"].split(",")], passes, device, timer, **shape)
    run_memory(ours, backward=False, device=device, **memory_shape)
    if backward:
        run_memory(ours, backward=True, device=device, **memory_shape)


if __name__ == "__main__":
    main()
