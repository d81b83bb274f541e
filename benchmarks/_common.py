"""What every benchmark shares: the command line (with --smoke), the "needs a CUDA GPU" exit,
timing, bandwidth, the printed table, RESULTS.md and the PNG plot.

Where results go (output_dir): $FLASH_ATTN_BENCH_OUT when set (the GPU check script points it at
its log folder so that the figures travel back from the GPU machine); else benchmarks/ for a real
run and, for a --smoke run, a temporary folder created per run and printed. A smoke run checks the
script, not the numbers (tiny shapes, CPU), so the tracked benchmarks/RESULTS.md and PNGs only
ever hold real runs.
"""

import argparse
import datetime
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

BENCH_DIR = Path(__file__).resolve().parent
OUT_ENV = "FLASH_ATTN_BENCH_OUT"
NO_CUDA_EXIT_CODE = 2

_smoke = False  # set by parse_args, the one place that decides it
_smoke_dir = None  # the smoke run's temporary output folder, made on first use


def time_ms(fn, warmup=25, rep=100):
    """Median milliseconds of fn() on the current CUDA device (triton's do_bench: CUDA events,
    L2 flushed between runs)."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def graph_ms(fn, calls=10, reps=20, flush_bytes=256 << 20):
    """Median milliseconds of fn() on the GPU alone: calls of fn, each after an L2 flush, are
    captured in one CUDA graph and replayed, so the CPU's launch cost is not in the figure (at
    small sizes Python and Triton's launch take longer than the kernel). The flushes are timed in
    a graph of their own and subtracted. fn may run a backward (autograd.grad) as well."""
    cache = torch.empty(flush_bytes // 4, dtype=torch.int32, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (allocator, autotuning) off the capture
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)

    def captured(with_fn):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                cache.zero_()
                if with_fn:
                    fn()
        return graph

    def replay_ms(graph):
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(reps):
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return sorted(times)[len(times) // 2]

    with_fn, flush_only = captured(True), captured(False)
    return max(replay_ms(with_fn) - replay_ms(flush_only), 1e-6) / calls


def wall_ms(fn, reps=3):
    """Mean wall-clock milliseconds of fn() over reps calls after one warm-up call: the timer of
    the CPU --smoke runs, which check a script, not its numbers."""
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps * 1e3


def gbps(nbytes, ms):
    return nbytes / ms / 1e6


def copy_bandwidth(src, timer=time_ms):
    """GB/s of a device-to-device copy of src (read + write): what a memory-bound kernel is
    measured against, in the same run."""
    dst = torch.empty_like(src)
    return gbps(2 * src.numel() * src.element_size(), timer(lambda: dst.copy_(src)))


def no_cuda_message(script):
    return f"{script}: needs a CUDA GPU (--smoke runs it on CPU with tiny shapes)"


def exit_without_cuda(script):
    """Exit with NO_CUDA_EXIT_CODE and no_cuda_message where there is no CUDA GPU."""
    if not torch.cuda.is_available():
        print(no_cuda_message(script), file=sys.stderr)
        sys.exit(NO_CUDA_EXIT_CODE)


def parse_args(description, compile_option=False, add_options=None, argv=None):
    """The benchmarks' command line: --smoke (tiny shapes on CPU, to check the script itself);
    with compile_option, --no-compile (skip the torch.compile peer); add_options(parser) adds the
    script's own. Without --smoke, exits (exit_without_cuda) where there is no CUDA GPU."""
    global _smoke
    parser = argparse.ArgumentParser(description=description, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes on CPU, to check the script; results go to a "
                             f"temporary folder (to ${OUT_ENV} when set), not benchmarks/")
    if compile_option:
        parser.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    if add_options is not None:
        add_options(parser)
    args = parser.parse_args(argv)
    _smoke = args.smoke
    if args.smoke:
        # Triton chooses compiled or interpreted kernels when a kernel is defined, so the
        # scripts import flash_attn's Triton ops only after this call.
        os.environ["TRITON_INTERPRET"] = "1"
        # Tiny shapes gain nothing from threads, and on a busy machine each hand-off between
        # threads can cost a scheduler tick (~15 ms).
        torch.set_num_threads(1)
    else:
        exit_without_cuda(parser.prog)
    return args


def note_stand_in(what):
    """Print (and so record in the run's log) what a smoke run measures in place of ours."""
    print(f"smoke run: {what}", flush=True)


def output_dir():
    """Where RESULTS.md and the PNGs go (see the module docstring), created."""
    global _smoke_dir
    if os.environ.get(OUT_ENV):
        out = Path(os.environ[OUT_ENV])
    elif not _smoke:
        out = BENCH_DIR
    else:
        if _smoke_dir is None:
            _smoke_dir = Path(tempfile.mkdtemp(prefix="flash_attn_bench_smoke_"))
            print(f"smoke run: RESULTS.md and plots go to {_smoke_dir} (benchmarks/ is left "
                  f"alone; set {OUT_ENV} to choose the folder)", flush=True)
        out = _smoke_dir
    out.mkdir(parents=True, exist_ok=True)
    return out


def environment():
    if _smoke:
        return f"smoke run (tiny shapes, CPU), torch {torch.__version__}"
    if not torch.cuda.is_available():
        return f"CPU, torch {torch.__version__}"
    return f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}"


def markdown_table(headers, rows):
    def fmt(x):
        return f"{x:.3g}" if isinstance(x, float) and abs(x) < 10 else (
            f"{x:.1f}" if isinstance(x, float) else str(x))

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


def report(title, headers, rows, notes=""):
    """Print the table and append it, dated, to output_dir()/RESULTS.md."""
    table = markdown_table(headers, rows)
    print(f"\n## {title}\n{table}", flush=True)
    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    with open(output_dir() / "RESULTS.md", "a") as f:
        f.write(f"\n## {title}\n{stamp}, {environment()}\n\n{table}\n")
        if notes:
            f.write(f"\n{notes}\n")


def save_plot(filename, title, xlabel, ylabel, series, xticks=None):
    """series: {label: (xs, ys)}. Writes output_dir()/filename (PNG); no-op without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot written")
        return
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for label, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o", label=label)
    if xticks is not None:
        ax.set_xscale("log", base=2)
        ax.set_xticks(xticks)
        ax.set_xticklabels([str(x) for x in xticks])
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = output_dir() / filename
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot written to {path}")
