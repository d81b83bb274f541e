"""Fused dropout + residual + LayerNorm, bf16: forward and backward GB/s on the GPU.

Ours (the `dropout_layer_norm` CUDA extension and the Triton kernels) against PyTorch eager and
torch.compile of the same computation, all in one run, next to the measured device-to-device copy
bandwidth. Two cases per shape:
  ln                 out = LayerNorm(x)
  dropout_add_ln     pre = dropout(x0, p=0.1) + residual; out = LayerNorm(pre); returns (out, pre)
GB/s counts every tensor of the operation once, the same bytes for every implementation (so GB/s
ratios are speed ratios); weights and per-row statistics are negligible and left out:
  ln               fwd: x read, out written (4 B/elt)      bwd: dout, x read, dx written (6 B/elt)
  dropout_add_ln   fwd: x0, residual read; out, pre, uint8 mask written (9 B/elt)
                   bwd: dout, dpre, pre, mask read; dx0, dresidual written (11 B/elt)
Also sweeps the CUDA kernels' vectors-per-thread choice (a tuning hook) and prints the issue's
done-when checks at 16k x 4096.
Usage: python benchmarks/benchmark_layer_norm.py [--smoke]   (--smoke: tiny shapes on CPU to check
the script itself: Triton in its interpreter, PyTorch's layer norm standing in for the CUDA
extension, no torch.compile peer and no launch sweep)
"""

import functools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (copy_bandwidth, gbps, note_stand_in, parse_args, report, save_plot,  # noqa: E402
                     time_ms, wall_ms)

SHAPES = [(16384, 1024), (16384, 4096), (8192, 8192)]
SMOKE_SHAPES = [(4, 64), (4, 256)]
CASES = ("ln", "dropout_add_ln")
DTYPE = torch.bfloat16
P = 0.1
EPS = 1e-5
BYTES_PER_ELT = {"ln": (4, 6), "dropout_add_ln": (9, 11)}  # (fwd, bwd)
CHECK_SHAPE, CHECK_CASE = (16384, 4096), "dropout_add_ln"


def copy_bandwidth_gbs(device, timer):
    numel = 128 * 1024 * 1024 if device == "cuda" else 1024 * 1024  # 256 MiB on the GPU
    return copy_bandwidth(torch.randn(numel, device=device, dtype=DTYPE), timer)


def eager(case):
    if case == "ln":
        return lambda x, w, b: (F.layer_norm(x, x.shape[-1:], w, b, EPS),)

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
            impls["cuda"] = {
                "ln": lambda x, w, b: (cuda_ln.layer_norm(x, w, b, EPS),),
                "dropout_add_ln": lambda x0, r, w, b: cuda_ln.dropout_add_layer_norm(
                    x0, r, w, b, P, EPS, prenorm=True),
            }
        else:
            print("CUDA extension dropout_layer_norm unavailable: its row is left out")
    # Imported here, after parse_args: --smoke turns Triton's interpreter on before the kernels
    # are defined.
    from flash_attn.ops.triton.layer_norm import layer_norm_fn

    impls["triton"] = {
        "ln": lambda x, w, b: (layer_norm_fn(x, w, b, eps=EPS),),
        "dropout_add_ln": lambda x0, r, w, b: layer_norm_fn(
            x0, w, b, residual=r, eps=EPS, dropout_p=P, prenorm=True),
    }
    impls["eager"] = {case: eager(case) for case in CASES}
    if not smoke:
        impls["compile"] = {case: torch.compile(eager(case), dynamic=False) for case in CASES}
    return impls


def make_inputs(case, M, N, device):
    x = torch.randn(M, N, device=device, dtype=DTYPE, requires_grad=True)
    w = torch.randn(N, device=device, dtype=DTYPE, requires_grad=True)
    b = torch.randn(N, device=device, dtype=DTYPE, requires_grad=True)
    if case == "ln":
        return [x, w, b]
    residual = torch.randn(M, N, device=device, dtype=DTYPE, requires_grad=True)
    return [x, residual, w, b]


def measure(fn, inputs, timer):
    """(forward ms, backward ms); the forward runs with autograd recording, as in training."""
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
    return fwd, bwd


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
            fwd, bwd = measure(fn, inputs, functools.partial(time_ms, rep=50))
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
    args = parse_args(__doc__)
    if args.smoke:
        device, timer = "cpu", functools.partial(wall_ms, reps=2)
        shapes, check_shape = SMOKE_SHAPES, SMOKE_SHAPES[-1]
    else:
        device, timer, shapes, check_shape = "cuda", time_ms, SHAPES, CHECK_SHAPE
    torch.manual_seed(0)
    copy_gbs = copy_bandwidth_gbs(device, timer)
    print(f"device-to-device copy: {copy_gbs:.0f} GB/s")
    impls = implementations(args.smoke)
    results = {}  # (impl, case, shape) -> (fwd ms, bwd ms)
    for M, N in shapes:
        for case in CASES:
            print(f"{M}x{N} {case} ...", flush=True)
            inputs = make_inputs(case, M, N, device)
            for name, fns in impls.items():
                results[name, case, (M, N)] = measure(fns[case], inputs, timer)
            if device == "cuda":
                torch.cuda.empty_cache()

    headers = ["shape", "case", "impl", "fwd ms", "fwd GB/s", "fwd % copy", "bwd ms", "bwd GB/s",
               "bwd % copy", "fwd x eager", "bwd x eager"]
    rows = []
    for (name, case, (M, N)), (fwd, bwd) in results.items():
        efwd, ebwd = results["eager", case, (M, N)]
        fg, bg = gbs(case, M, N, fwd, 0), gbs(case, M, N, bwd, 1)
        rows.append([f"{M}x{N}", case, name, fwd, fg, 100 * fg / copy_gbs, bwd, bg,
                     100 * bg / copy_gbs, efwd / fwd, ebwd / bwd])
    rows.sort(key=lambda r: (r[0], r[1], r[2]))
    report("Dropout + residual + LayerNorm, bf16", headers, rows,
           notes=f"copy bandwidth {copy_gbs:.0f} GB/s (measured in the same run); bytes per "
                 f"element counted (fwd, bwd): {BYTES_PER_ELT}; dropout p = {P}")

    for direction, label in ((0, "fwd"), (1, "bwd")):
        series = {}
        for name in impls:
            for case in CASES:
                xs = [N for _, N in shapes]
                ys = [gbs(case, M, N, results[name, case, (M, N)][direction], direction)
                      for M, N in shapes]
                series[f"{name} {case}"] = (xs, ys)
        series["copy"] = ([N for _, N in shapes], [copy_gbs] * len(shapes))
        save_plot(f"layer_norm_{label}.png", f"Dropout + residual + LayerNorm {label}, bf16 "
                  f"({', '.join(shape_label(M, N) for M, N in shapes)})", "hidden size", "GB/s",
                  series, xticks=[N for _, N in shapes])

    if args.smoke:
        print("smoke run: no CUDA launch sweep (it tunes the CUDA extension)")
    else:
        sweep_cuda(copy_gbs)

    # The done-when checks.
    M, N = check_shape
    print(f"\n## done-when checks: {CHECK_CASE}, {M}x{N}, bf16, copy {copy_gbs:.0f} GB/s")
    efwd, ebwd = results["eager", CHECK_CASE, check_shape]
    bound_fwd = efwd / (BYTES_PER_ELT[CHECK_CASE][0] * M * N / copy_gbs * 1e-6)
    bound_bwd = ebwd / (BYTES_PER_ELT[CHECK_CASE][1] * M * N / copy_gbs * 1e-6)
    print(f"eager fwd {efwd:.3f} ms, bwd {ebwd:.3f} ms; at 100% of copy bandwidth the counted "
          f"bytes allow at most {bound_fwd:.2f}x (fwd) / {bound_bwd:.2f}x (bwd) over eager")
    all_ok = True
    for name in ("cuda", "triton"):
        if (name, CHECK_CASE, check_shape) not in results:
            print(f"{name}: not measured -> FAIL")
            all_ok = False
            continue
        fwd, bwd = results[name, CHECK_CASE, check_shape]
        fg, bg = gbs(CHECK_CASE, M, N, fwd, 0), gbs(CHECK_CASE, M, N, bwd, 1)
        checks = [
            (f"fwd {fg:.0f} GB/s >= 75% of copy ({0.75 * copy_gbs:.0f})", fg >= 0.75 * copy_gbs),
            (f"bwd {bg:.0f} GB/s >= 60% of copy ({0.60 * copy_gbs:.0f})", bg >= 0.60 * copy_gbs),
            (f"fwd {efwd / fwd:.2f}x eager >= 2.5x", efwd / fwd >= 2.5),
            (f"bwd {ebwd / bwd:.2f}x eager >= 2.5x", ebwd / bwd >= 2.5),
        ]
        for text, ok in checks:
            print(f"{name}: {text}: {'PASS' if ok else 'FAIL'}")
            all_ok &= ok if name == "cuda" else True
    print("done-when (CUDA):", "PASS" if all_ok else "FAIL")
    return 0


if __name__ == "__main__":
    sys.exit(main())
