"""Rotary embedding GB/s: apply_rotary (Triton) vs the PyTorch formulation (eager and
torch.compile), and vs a device-to-device copy of the same tensor, all measured in the same run.

Bytes moved: x read + output written (+ the cos/sin tables); in place, only the rotary part.
Done-when check: apply_rotary (out of place) >= 70% of the measured copy bandwidth.
Usage: python benchmarks/benchmark_rotary.py [--smoke] [--no-compile]   (--smoke: tiny shapes
on CPU, Triton in its interpreter, to check the script itself)
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import copy_bandwidth, gbps, parse_args, report, save_plot, time_ms, wall_ms  # noqa: E402

# flash_attn's rotary modules define Triton kernels, so they are imported in the functions below,
# after parse_args has turned Triton's interpreter on for --smoke.

TARGET = 0.70


def _inputs(batch, seqlen, heads, headdim, rotary_dim, device, dtype=torch.bfloat16):
    x = torch.randn(batch, seqlen, heads, headdim, device=device, dtype=dtype)
    angle = torch.rand(seqlen, rotary_dim // 2, device=device) * 6.28
    return x, angle.cos().to(dtype), angle.sin().to(dtype)


def measure(batch, seqlen, heads, headdim, rotary_dim, interleaved, device, timer, compiled):
    from flash_attn.layers.rotary import apply_rotary_emb_torch
    from flash_attn.ops.triton.rotary import apply_rotary

    x, cos, sin = _inputs(batch, seqlen, heads, headdim, rotary_dim, device)
    elt = x.element_size()
    table_bytes = 2 * cos.numel() * elt
    full_bytes = 2 * x.numel() * elt + table_bytes
    rotary_bytes = 2 * x.numel() // headdim * rotary_dim * elt + table_bytes
    x_inplace = x.clone()
    result = {
        "copy": copy_bandwidth(x, timer),
        "ours": gbps(full_bytes, timer(lambda: apply_rotary(x, cos, sin,
                                                             interleaved=interleaved))),
        # Rotating the same tensor again and again keeps its norm: fine for timing.
        "ours in place": gbps(rotary_bytes, timer(lambda: apply_rotary(
            x_inplace, cos, sin, interleaved=interleaved, inplace=True))),
        "torch eager": gbps(full_bytes, timer(lambda: apply_rotary_emb_torch(
            x, cos, sin, interleaved))),
    }
    result["torch.compile"] = float("nan")
    if compiled is not None:
        result["torch.compile"] = gbps(full_bytes,
                                        timer(lambda: compiled(x, cos, sin, interleaved)))
    # Correctness guard: a fast wrong kernel must not pass.
    torch.testing.assert_close(apply_rotary(x, cos, sin, interleaved=interleaved),
                               apply_rotary_emb_torch(x.float(), cos.float(), sin.float(),
                                                      interleaved).to(x.dtype),
                               rtol=2e-2, atol=2e-2)
    return result


def run_main(shape, device, timer, compiled):
    batch, seqlen, heads, headdim = shape
    rows, checks = [], []
    for rotary_dim in (headdim, headdim // 2):
        for interleaved in (False, True):
            r = measure(batch, seqlen, heads, headdim, rotary_dim, interleaved, device, timer,
                        compiled)
            ratio = r["ours"] / r["copy"]
            rows.append([rotary_dim, "GPT-J" if interleaved else "NeoX", r["ours"],
                         r["ours in place"], r["torch eager"], r["torch.compile"], r["copy"],
                         ratio, r["ours"] / r["torch eager"], r["ours"] / r["torch.compile"]])
            checks.append((rotary_dim, interleaved, ratio))
            print(rows[-1], flush=True)
    headers = ["rotary_dim", "layout", "ours GB/s", "ours in place GB/s", "torch eager GB/s",
               "torch.compile GB/s", "copy GB/s", "ours / copy", "ours / eager",
               "ours / compiled"]
    report(f"Rotary embedding (apply_rotary vs PyTorch, b={batch} s={seqlen} h={heads} "
           f"d={headdim}, bf16)", headers, rows,
           notes="GB/s of x read + out written + cos/sin; in place: the rotary part only. "
                 "Copy: y.copy_(x) of the same tensor, same run.")
    for rotary_dim, interleaved, ratio in checks:
        verdict = "PASS" if ratio >= TARGET else "FAIL"
        print(f"CHECK rotary_dim={rotary_dim} {'GPT-J' if interleaved else 'NeoX'}: ours / copy "
              f"= {ratio:.2f} (target >= {TARGET:.2f}): {verdict}")
    return rows


def run_seqlen_plot(seqlens, shape, device, timer, compiled):
    batch, _, heads, headdim = shape
    series = {}
    for seqlen in seqlens:
        print(f"seqlen {seqlen} ...", flush=True)
        r = measure(batch, seqlen, heads, headdim, headdim, False, device, timer, compiled)
        for name in ("ours", "torch eager", "torch.compile", "copy"):
            series.setdefault(name, ([], []))
            series[name][0].append(seqlen)
            series[name][1].append(r[name])
    save_plot("rotary.png",
              f"Rotary (NeoX, full rotary dim), b={batch} h={heads} d={headdim}, bf16",
              "sequence length", "GB/s", series, xticks=list(seqlens))


def run_config_sweep(shape, device, timer):
    """GB/s of a few launch configurations, to check the default heuristic."""
    from flash_attn.ops.triton.rotary import _launch

    batch, seqlen, heads, headdim = shape
    rows = []
    for interleaved in (False, True):
        x, cos, sin = _inputs(batch, seqlen, heads, headdim, headdim, device)
        out = torch.empty_like(x)
        nbytes = 2 * x.numel() * x.element_size() + 2 * cos.numel() * cos.element_size()
        for block_m, block_h, num_warps in ((None, None, None), (1, 16, 4), (2, 16, 4),
                                            (2, 16, 8), (4, 8, 4), (4, 8, 8), (8, 4, 4),
                                            (1, 32, 8), (4, 16, 8)):
            ms = timer(lambda: _launch(out, x, cos, sin, 0, None, None, interleaved, False,
                                       block_m=block_m, block_h=block_h, num_warps=num_warps))
            config = ("default" if block_m is None
                      else f"{block_m}x{block_h}, {num_warps} warps")
            rows.append(["GPT-J" if interleaved else "NeoX", config, gbps(nbytes, ms)])
    report(f"Rotary launch configurations (b={batch} s={seqlen} h={heads} d={headdim}, bf16)",
           ["layout", "BLOCK_M x BLOCK_H, warps", "GB/s"], rows)


def main():
    args = parse_args(__doc__, compile_option=True)
    if args.smoke:
        device, timer, shape, seqlens = "cpu", wall_ms, (1, 8, 2, 16), (8, 16)
    else:
        device, timer, shape = "cuda", time_ms, (8, 2048, 32, 128)
        seqlens = (1024, 2048, 4096, 8192)
    compiled = None
    if not args.no_compile and not args.smoke:
        # One specialisation per (shape, layout): lift dynamo's default limit of 8.
        for knob in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, knob):
                setattr(torch._dynamo.config, knob, 64)
        from flash_attn.layers.rotary import apply_rotary_emb_torch

        compiled = torch.compile(apply_rotary_emb_torch, dynamic=False)
    run_main(shape, device, timer, compiled)
    run_config_sweep(shape, device, timer)
    run_seqlen_plot(seqlens, shape, device, timer, compiled)


if __name__ == "__main__":
    main()
