"""LayerNorm / RMSNorm and fused dropout + residual + LayerNorm, bf16: forward and backward GB/s.

Ours (the `dropout_layer_norm` CUDA extension and the Triton kernels) against PyTorch eager,
torch.compile of the same computation and Liger-Kernel (when importable), all in one run, next to
the measured device-to-device copy bandwidth. Three cases per shape:
  ln                 out = LayerNorm(x)
  rms                out = RMSNorm(x)
  dropout_add_ln     pre = dropout(x0, p=0.1) + residual; out = LayerNorm(pre); returns (out, pre)
GB/s counts every tensor of the operation once, the same bytes for every implementation (so GB/s
ratios are speed ratios); weights and per-row statistics are negligible and left out:
  ln, rms          fwd: x read, out written (4 B/elt)      bwd: dout, x read, dx written (6 B/elt)
  dropout_add_ln   fwd: x0, residual read; out, pre, uint8 mask written (9 B/elt)
                   bwd: dout, dpre, pre, mask read; dx0, dresidual written (11 B/elt)
Two timings of each: "launch" (do_bench: one call at a time from Python, what an eager training
loop sees, the CPU's launch cost included where it exceeds the kernel's) and "graph" (the calls
replayed from a CUDA graph: the GPU's time alone, what a graph-captured or compiled step sees).
--sweep also sweeps the CUDA kernels' vectors-per-thread choice (a tuning hook).
Usage: python benchmarks/benchmark_layer_norm.py [--smoke] [--sweep]   (--smoke: tiny shapes on
CPU to check the script itself: Triton in its interpreter, PyTorch's layer norm standing in for
the CUDA extension, no torch.compile or Liger peer, no graph timing and no launch sweep)
"""

import functools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (copy_bandwidth, gbps, graph_ms, note_stand_in, parse_args, report,  # noqa: E402
                     save_plot, time_ms, wall_ms)

SHAPES = [(16384, 1024), (16384, 2048), (16384, 4096), (8192, 8192)]
SMOKE_SHAPES = [(4, 64), (4, 256)]
CASES = ("ln", "rms", "dropout_add_ln")
DTYPE = torch.bfloat16
P = 0.1
EPS = 1e-5
BYTES_PER_ELT = {"ln": (4, 6), "rms": (4, 6), "dropout_add_ln": (9, 11)}  # (fwd, bwd)
TRITON_BAR = 0.85  # issue "training": the Triton kernels at >= 85% of copy, hidden 1k-8k


def copy_bandwidth_gbs(device, timer):
    numel = 128 * 1024 * 1024 if device == "cuda" else 1024 * 1024  # 256 MiB on the GPU
    return copy_bandwidth(torch.randn(numel, device=device, dtype=DTYPE), timer)


def eager(case):
    if case == "ln":
        return lambda x, w, b: (F.layer_norm(x, x.shape[-1:], w, b, EPS),)
    if case == "rms":
        return lambda x, w: (F.rms_norm(x, x.shape[-1:], w, EPS),)

    def dropout_add_ln(x0, residual, w, b):
        pre = F.dropout(x0, P, training=True) + residual
        return F.layer_norm(pre, pre.shape[-1:], w, b, EPS), pre

    return dropout_add_ln


def implementations(smoke):
    """name -> case -> fn(*inputs) returning a tuple of outputs. smoke: PyTorch eager stands in
    for the CUDA extension, and torch.compile is left out (minutes of C++ builds on CPU)."""
    impls = {}
    if smoke:
        note_stand_in("'cuda' is PyTorch eager (dropout_layer_norm needs CUDA); Triton runs in its "
                      "interpreter; no torch.compile peer")
        impls["cuda"] = {case: eager(case) for case in CASES}
    else:
        from flash_attn._native import extension_available
        from flash_attn.ops import layer_norm as cuda_ln  # imports without the extension

        if extension_available("dropout_layer_norm"):
            from flash_attn.ops import rms_norm as cuda_rms

            impls["cuda"] = {
                "ln": lambda x, w, b: (cuda_ln.layer_norm(x, w, b, EPS),),
                "rms": lambda x, w: (cuda_rms.rms_norm(x, w, EPS),),
                "dropout_add_ln": lambda x0, r, w, b: cuda_ln.dropout_add_layer_norm(
                    x0, r, w, b, P, EPS, prenorm=True),
            }
        else:
            print("CUDA extension dropout_layer_norm unavailable: its row is left out")
    # Imported here, after parse_args: --smoke turns Triton's interpreter on before the kernels
    # are defined.
    from flash_attn.ops.triton.layer_norm import layer_norm_fn, rms_norm_fn

    impls["triton"] = {
        "ln": lambda x, w, b: (layer_norm_fn(x, w, b, eps=EPS),),
        "rms": lambda x, w: (rms_norm_fn(x, w, None, eps=EPS),),
        "dropout_add_ln": lambda x0, r, w, b: layer_norm_fn(
            x0, w, b, residual=r, eps=EPS, dropout_p=P, prenorm=True),
    }
    impls["eager"] = {case: eager(case) for case in CASES}
    if not smoke:
        impls["compile"] = {case: torch.compile(eager(case), dynamic=False) for case in CASES}
        try:
            from liger_kernel.ops.layer_norm import LigerLayerNormFunction
            from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        except ImportError as error:
            print(f"Liger-Kernel unavailable ({error}): its rows are left out")
        else:
            impls["liger"] = {
                "ln": lambda x, w, b: (LigerLayerNormFunction.apply(x, w, b, EPS),),
                "rms": lambda x, w: (LigerRMSNormFunction.apply(x, w, EPS),),
            }
    return impls


def make_inputs(case, M, N, device):
    x = torch.randn(M, N, device=device, dtype=DTYPE, requires_grad=True)
    w = torch.randn(N, device=device, dtype=DTYPE, requires_grad=True)
    b = torch.randn(N, device=device, dtype=DTYPE, requires_grad=True)
    if case == "ln":
        return [x, w, b]
    if case == "rms":
        return [x, w]
    residual = torch.randn(M, N, device=device, dtype=DTYPE, requires_grad=True)
    return [x, residual, w, b]


def measure(fn, inputs, timer, graphs):
    """(forward ms, backward ms, forward graph ms, backward graph ms); the forward runs with
    autograd recording, as in training. The graph figures (None without graphs or where fn cannot
    be captured): the backward is (forward + backward) - forward."""
    for _ in range(3):  # compile / JIT outside the timed region
        outs = fn(*inputs)
        torch.autograd.grad(outs, inputs, [torch.ones_like(o) for o in outs])
    fwd = timer(lambda: fn(*inputs))
    outs = fn(*inputs)
    grads = [torch.randn_like(o) for o in outs]
    try:
        bwd = timer(lambda: torch.autograd.grad(outs, inputs, grads, retain_graph=True))
    except RuntimeError:  # a backward that cannot run twice on one graph: time fwd + bwd
        both = timer(lambda: torch.autograd.grad(fn(*inputs), inputs, grads))
        bwd = both - fwd
    del outs
    fwd_graph = bwd_graph = None
    if graphs:
        try:
            fwd_graph = graph_ms(lambda: fn(*inputs))
            bwd_graph = graph_ms(lambda: torch.autograd.grad(fn(*inputs), inputs, grads)) - fwd_graph
        except RuntimeError as error:  # not capturable: say so, keep the launch figures
            print(f"  CUDA graph capture failed: {str(error).splitlines()[0][:160]}")
            torch.cuda.synchronize()
    return fwd, bwd, fwd_graph, bwd_graph


def gbs(case, M, N, ms, direction):
    return gbps(BYTES_PER_ELT[case][direction] * M * N, ms)


def sweep_cuda(copy_gbs):
    """GB/s of the CUDA kernels for each valid vectors-per-thread choice (dropout_add_ln)."""
    try:
        import dropout_layer_norm
        from flash_attn.ops import layer_norm as cuda_ln
    except ImportError:
        return
    rows = []
    for M, N in SHAPES:
        print(f"launch sweep {M}x{N} ...", flush=True)
        vecs = N // 8
        inputs = make_inputs("dropout_add_ln", M, N, "cuda")
        fn = lambda x0, r, w, b: cuda_ln.dropout_add_layer_norm(  # noqa: E731
            x0, r, w, b, P, EPS, prenorm=True)
        for fwd_nv, bwd_nv in [(1, 1), (2, 2), (4, 2)]:
            tpr_fwd = 1 << max(0, (-(-vecs // fwd_nv) - 1).bit_length())
            tpr_bwd = 1 << max(0, (-(-vecs // bwd_nv) - 1).bit_length())
            fwd_ok, bwd_ok = tpr_fwd <= 256, tpr_bwd <= 512
            if not (fwd_ok or bwd_ok):
                continue
            dropout_layer_norm._set_vecs_per_thread(fwd_nv if fwd_ok else 0,
                                                    bwd_nv if bwd_ok else 0)
            fwd, bwd, _, _ = measure(fn, inputs, functools.partial(time_ms, rep=50), graphs=False)
            rows.append([f"{M}x{N}", fwd_nv if fwd_ok else "-",
                         gbs("dropout_add_ln", M, N, fwd, 0) if fwd_ok else "-",
                         bwd_nv if bwd_ok else "-",
                         gbs("dropout_add_ln", M, N, bwd, 1) if bwd_ok else "-"])
        dropout_layer_norm._set_vecs_per_thread(0, 0)
    report("dropout_add_ln CUDA launch sweep (vectors of 8 per thread), bf16, GB/s",
           ["shape", "fwd vecs", "fwd GB/s", "bwd vecs", "bwd GB/s"], rows,
           notes=f"copy bandwidth {copy_gbs:.0f} GB/s; the built-in choice is used elsewhere")


def shape_label(M, N):
    return f"{M // 1024}k x {N}" if M % 1024 == 0 else f"{M} x {N}"


def main():
    args = parse_args(__doc__, add_options=lambda p: p.add_argument(
        "--sweep", action="store_true", help="also sweep the CUDA kernels' vectors per thread"))
    if args.smoke:
        device, timer = "cpu", functools.partial(wall_ms, reps=2)
        shapes = SMOKE_SHAPES
    else:
        device, timer, shapes = "cuda", time_ms, SHAPES
    torch.manual_seed(0)
    copy_gbs = copy_bandwidth_gbs(device, timer)
    print(f"device-to-device copy: {copy_gbs:.0f} GB/s")
    impls = implementations(args.smoke)
    results = {}  # (impl, case, shape) -> (fwd ms, bwd ms, fwd graph ms, bwd graph ms)
    for M, N in shapes:
        for case in CASES:
            print(f"{M}x{N} {case} ...", flush=True)
            inputs = make_inputs(case, M, N, device)
            for name, fns in impls.items():
                if case in fns:
                    results[name, case, (M, N)] = measure(fns[case], inputs, timer,
                                                          graphs=device == "cuda")
            if device == "cuda":
                torch.cuda.empty_cache()

    def ratio(t, base):
        return base / t if t and base else "-"

    def gb(case, M, N, t, direction):
        return gbs(case, M, N, t, direction) if t else "-"

    def pct(case, M, N, t, direction):
        return 100 * gbs(case, M, N, t, direction) / copy_gbs if t else "-"

    headers = ["shape", "case", "impl", "fwd ms", "fwd GB/s", "fwd % copy", "bwd ms", "bwd GB/s",
               "bwd % copy", "graph fwd GB/s", "graph fwd % copy", "graph bwd GB/s",
               "graph bwd % copy", "fwd x eager", "bwd x eager"]
    rows = []
    for (name, case, (M, N)), (fwd, bwd, gfwd, gbwd) in results.items():
        efwd, ebwd, _, _ = results["eager", case, (M, N)]
        rows.append([f"{M}x{N}", case, name, fwd, gb(case, M, N, fwd, 0), pct(case, M, N, fwd, 0),
                     bwd, gb(case, M, N, bwd, 1), pct(case, M, N, bwd, 1),
                     gb(case, M, N, gfwd, 0), pct(case, M, N, gfwd, 0),
                     gb(case, M, N, gbwd, 1), pct(case, M, N, gbwd, 1),
                     ratio(fwd, efwd), ratio(bwd, ebwd)])
    rows.sort(key=lambda r: (r[0], r[1], r[2]))
    report("LayerNorm / RMSNorm / dropout + residual + LayerNorm, bf16", headers, rows,
           notes=f"copy bandwidth {copy_gbs:.0f} GB/s (measured in the same run); bytes per "
                 f"element counted (fwd, bwd): {BYTES_PER_ELT}; dropout p = {P}. launch: "
                 f"do_bench, one call at a time; graph: replayed from a CUDA graph (GPU time alone)")

    for direction, label in ((0, "fwd"), (1, "bwd")):
        series = {}
        for (name, case, _), _ in results.items():
            xs = [N for M, N in shapes if (name, case, (M, N)) in results]
            ys = [gbs(case, M, N, results[name, case, (M, N)][direction], direction)
                  for M, N in shapes if (name, case, (M, N)) in results]
            series[f"{name} {case}"] = (xs, ys)
        series["copy"] = ([N for _, N in shapes], [copy_gbs] * len(shapes))
        save_plot(f"layer_norm_{label}.png", f"LayerNorm / RMSNorm / dropout_add_ln {label} "
                  f"(launch timing), bf16 ({', '.join(shape_label(M, N) for M, N in shapes)})",
                  "hidden size", "GB/s", series, xticks=[N for _, N in shapes])

    if args.sweep and not args.smoke:
        sweep_cuda(copy_gbs)

    # Issue "training": the Triton kernels at >= 85% of copy bandwidth, hidden 1k-8k, fwd and bwd.
    print(f"\n## Triton >= {TRITON_BAR:.0%} of copy ({copy_gbs:.0f} GB/s), launch / graph timing")
    for (name, case, (M, N)), times in sorted(results.items()):
        if name != "triton":
            continue
        marks = []
        for label, t, direction in (("fwd", times[0], 0), ("bwd", times[1], 1),
                                    ("graph fwd", times[2], 0), ("graph bwd", times[3], 1)):
            if t:
                share = gbs(case, M, N, t, direction) / copy_gbs
                marks.append(f"{label} {share:.0%} {'PASS' if share >= TRITON_BAR else 'FAIL'}")
        print(f"{case} {M}x{N}: " + ", ".join(marks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
