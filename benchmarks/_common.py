"""What every benchmark shares: timing, bandwidth, the command line, the printed table, RESULTS.md
and the PNG plot.

Results go to benchmarks/ by default, or to $FLASH_ATTN_BENCH_OUT (the GPU check script points
it at its log folder so that the figures travel back from the GPU machine).
"""

import argparse
import datetime
import os
import time
from pathlib import Path

import torch

OUT_DIR = Path(os.environ.get("FLASH_ATTN_BENCH_OUT", Path(__file__).resolve().parent))


def time_ms(fn, warmup=25, rep=100):
    """Median milliseconds of fn() on the current CUDA device (triton's do_bench: CUDA events,
    L2 flushed between runs)."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


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


def parse_args(description, compile_option=False):
    """The benchmarks' command line: --smoke (tiny shapes on CPU, to check the script itself) and,
    with compile_option, --no-compile (skip the torch.compile peer)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU")
    if compile_option:
        parser.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    return parser.parse_args()


def environment():
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
    """Print the table and append it, dated, to RESULTS.md."""
    table = markdown_table(headers, rows)
    print(f"\n## {title}\n{table}")
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    with open(OUT_DIR / "RESULTS.md", "a") as f:
        f.write(f"\n## {title}\n{stamp}, {environment()}\n\n{table}\n")
        if notes:
            f.write(f"\n{notes}\n")


def save_plot(filename, title, xlabel, ylabel, series, xticks=None):
    """series: {label: (xs, ys)}. Writes OUT_DIR/filename (PNG); no-op without matplotlib."""
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
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    fig.savefig(OUT_DIR / filename, dpi=120)
    plt.close(fig)
    print(f"plot written to {OUT_DIR / filename}")
