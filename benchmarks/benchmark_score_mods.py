"""Attention with a score modifier, forward and backward TFLOP/s: ours vs PyTorch's FlexAttention
under torch.compile, measured in the same run (issue "Hopper v2": >= 1.0x compiled FlexAttention).

Cases (bf16, d 128, 16k tokens per batch, hidden 2048): a causal sliding window of 1024 keys,
softcap 30 (causal) and ALiBi (causal). FlexAttention gets each as its own score_mod / block mask,
so both sides skip the same key blocks; FLOPs count only the (query, key) pairs the mask keeps, the
same count for both. Before timing, the outputs of the two are compared (max abs difference).
Usage: python benchmarks/benchmark_score_mods.py [--seqlens 2048,8192] [--passes fwd,bwd] [--smoke]
--smoke: tiny shapes on CPU, to check the script; "ours" is then the reference attention in fp32
and FlexAttention runs uncompiled, forward only (it has no CPU backward).
"""

import functools
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import note_stand_in, parse_args, report, save_plot, time_ms, wall_ms  # noqa: E402
from benchmark_flash_attention import FLOP_FACTOR, HIDDEN, TOKENS, time_pass  # noqa: E402

from flash_attn import flash_attn_func  # noqa: E402
from flash_attn.modules.mha import get_alibi_slopes  # noqa: E402
from flash_attn.utils.testing import attention_ref  # noqa: E402

WINDOW, SOFTCAP = 1024, 30.0
HEAD_DIM = 128
BAR = 1.0  # ours / compiled FlexAttention, fwd and bwd


def kept_pairs(seqlen, window):
    """(query, key) pairs a causal mask with a left window keeps (window < 0: causal only)."""
    w = seqlen if window < 0 else window
    # Row i keeps min(i, w) + 1 keys.
    full = max(seqlen - w, 0) * (w + 1)
    ramp = min(seqlen, w) * (min(seqlen, w) + 1) // 2
    return full + ramp


def cases(heads, device):
    """{name: (window, ours kwargs, flex score_mod or None)}; every case is causal."""
    slopes = torch.tensor(get_alibi_slopes(heads), device=device, dtype=torch.float32)

    def softcap_mod(score, b, h, q_idx, kv_idx):
        return SOFTCAP * torch.tanh(score / SOFTCAP)

    def alibi_mod(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx).abs()

    return {
        f"window {WINDOW}": (WINDOW, dict(window_size=(WINDOW, 0)), None),
        f"softcap {SOFTCAP:g}": (-1, dict(softcap=SOFTCAP), softcap_mod),
        "ALiBi": (-1, dict(alibi_slopes=slopes), alibi_mod),
    }


def reference_stand_in(q, k, v, causal=True, window_size=(-1, -1), softcap=0.0, alibi_slopes=None):
    """--smoke only: flash_attn_func's result from the fp32 reference attention."""
    return attention_ref(q, k, v, causal=causal, window_size=window_size, softcap=softcap,
                         alibi_slopes=alibi_slopes)[0]


def flex_fn(flex_attention, create_block_mask, batch, heads, seqlen, window, score_mod, device):
    def mask_mod(b, h, q_idx, kv_idx):
        keep = q_idx >= kv_idx
        return keep & (q_idx - kv_idx <= window) if window >= 0 else keep

    block_mask = create_block_mask(mask_mod, batch, heads, seqlen, seqlen, device=device)
    return functools.partial(flex_attention, score_mod=score_mod, block_mask=block_mask)


def main():
    def add_options(parser):
        parser.add_argument("--seqlens", help="comma-separated (default 2048,8192)")
        parser.add_argument("--passes", help="comma-separated (default fwd,bwd)")

    args = parse_args(__doc__, add_options=add_options)
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    passes = (args.passes or ("fwd" if args.smoke else "fwd,bwd")).split(",")
    backward = "bwd" in passes
    if args.smoke:
        note_stand_in("'ours' is the fp32 reference attention on CPU and FlexAttention runs "
                      "uncompiled (our kernels and compiled FlexAttention need CUDA)")
        device, dtype, timer = "cpu", torch.float32, functools.partial(wall_ms, reps=2)
        seqlens, tokens, hidden, d = [int(s) for s in (args.seqlens or "64,128").split(",")], 256, 32, 16
        ours, flex = reference_stand_in, flex_attention
    else:
        device, dtype, timer = "cuda", torch.bfloat16, time_ms
        seqlens, tokens, hidden, d = [int(s) for s in (args.seqlens or "2048,8192").split(",")], TOKENS, HIDDEN, \
            HEAD_DIM
        ours, flex = flash_attn_func, None  # compiled afresh for each case, below
        # Past dynamo's recompile limit FlexAttention silently ran eagerly (6-12 TFLOP/s at s8k, in
        # one run's ALiBi and softcap cases): a peer that fails to compile must stop the run instead.
        torch._dynamo.config.fail_on_recompile_limit_hit = True
    heads = hidden // d
    rows, series, worst = [], {}, {}
    for seqlen in seqlens:
        batch = max(tokens // seqlen, 1)
        for name, (window, kwargs, score_mod) in cases(heads, device).items():
            print(f"s={seqlen} {name} ...", flush=True)
            q, k, v = (torch.randn(batch, seqlen, heads, d, device=device, dtype=dtype, requires_grad=backward)
                       for _ in range(3))
            # FlexAttention takes (b, h, s, d); contiguous in that layout so it copies nothing.
            qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_(backward) for x in (q, k, v))
            if device == "cuda":  # each case's own compilation: the cases' graphs do not pile up
                torch._dynamo.reset()
                flex = torch.compile(flex_attention, dynamic=False)
            flex_call = flex_fn(flex, create_block_mask, batch, heads, seqlen, window, score_mod, device)
            fns = {"ours": ((q, k, v), lambda: ours(q, k, v, causal=True, **kwargs)),
                   "flex": ((qt, kt, vt), lambda: flex_call(qt, kt, vt))}
            with torch.no_grad():
                diff = (fns["ours"][1]().float() - fns["flex"][1]().transpose(1, 2).float()).abs().max().item()
            pairs = kept_pairs(seqlen, window)
            for kind in passes:
                flops = 4 * batch * heads * d * pairs * FLOP_FACTOR[kind]
                tflops = {m: flops / time_pass(inputs, fn, kind, timer) / 1e9 for m, (inputs, fn) in fns.items()}
                ratio = tflops["ours"] / tflops["flex"]
                rows.append([kind, name, seqlen, batch, heads, tflops["ours"], tflops["flex"], ratio, diff])
                print(rows[-1], flush=True)
                worst[kind, name] = min(worst.get((kind, name), math.inf), ratio)
                xs, ys = series.setdefault(f"{kind} {name}", ([], []))
                xs.append(seqlen)
                ys.append(ratio)
    report(f"Attention with score modifiers (flash_attn_func vs compiled FlexAttention, same run), d{d}",
           ["pass", "case", "seqlen", "batch", "heads", "ours TFLOP/s", "FlexAttention TFLOP/s",
            "ours / flex", "max |ours - flex|"], rows,
           notes=f"causal, {tokens // 1024}k tokens per batch, hidden {hidden}, {dtype}; FLOPs: 4*b*h*d per kept "
                 "(query, key) pair, backward 2.5x; the same count for both.")
    save_plot("score_mods.png", "Score modifiers: ours / compiled FlexAttention", "sequence length",
              "speedup (x)", series, xticks=seqlens)
    print("\n## Done-when check")
    for (kind, name), ratio in worst.items():
        print(f"[{'PASS' if ratio >= BAR else 'FAIL'}] {kind} {name}: ours >= {BAR}x compiled FlexAttention "
              f"(worst {ratio:.3f}x)")


if __name__ == "__main__":
    main()
