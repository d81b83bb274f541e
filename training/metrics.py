"""What a run reports: throughput and MFU, the progress bar (tqdm when installed, else a plain
line every few seconds) and the loss plot."""

import collections
import io
import sys
import time

import torch

from training.checkpoint import write_atomic

# Dense bf16 tensor-core peaks from the vendors' data sheets (SXM parts), TFLOP/s; matched in
# order against the device name, so longer names come first.
PEAK_BF16_TFLOPS = [("H200", 989.0), ("H100", 989.0), ("H800", 989.0), ("B200", 2250.0),
                    ("A100", 312.0), ("A800", 312.0), ("L40S", 362.0), ("L4", 121.0),
                    ("A10", 125.0), ("4090", 165.0)]


def peak_flops(device, tflops=None):
    """(FLOP/s, where the figure comes from) to divide achieved FLOP/s by for MFU: tflops if
    given, a known GPU's bf16 peak, else the rate of a large matmul measured here (CPUs)."""
    if tflops is not None:
        return tflops * 1e12, "--peak-tflops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peak in PEAK_BF16_TFLOPS:
            if key in name:
                return peak * 1e12, f"{name} bf16 peak"
    return _measured_matmul_flops(device), "measured matmul rate"


def _measured_matmul_flops(device, n=1024, reps=3):
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    # Its own generator: drawing from the global one would shift a resumed run's dropout masks.
    generator = torch.Generator(device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=generator)
    best = float("inf")
    for _ in range(reps + 1):  # the first call warms up
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        a @ a
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * n ** 3 / best


class Throughput:
    """Tokens per second over the last `window` steps (steps only: evaluation and
    checkpoints are left out)."""

    def __init__(self, window=20):
        self.steps = collections.deque(maxlen=window)

    def add(self, tokens, seconds):
        self.steps.append((tokens, seconds))

    def tokens_per_second(self):
        seconds = sum(s for _, s in self.steps)
        return sum(t for t, _ in self.steps) / seconds if seconds > 0 else 0.0


class Progress:
    """A progress bar over the steps with the latest loss, tokens/s and MFU; messages printed
    above it. Only the main process shows anything."""

    PLAIN_EVERY_S = 10.0

    def __init__(self, total, initial, enabled):
        self.enabled, self.total = enabled, total
        self.bar = None
        self._last_plain = 0.0
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True,
                                mininterval=0.5, file=sys.stderr)

    def update(self, step, loss, tokens_per_s, mfu):
        if not self.enabled:
            return
        fields = f"loss {loss:.4f} | {tokens_per_s:,.0f} tok/s | MFU {100 * mfu:.1f}%"
        if self.bar is not None:
            self.bar.set_postfix_str(fields, refresh=False)
            self.bar.update(1)
        elif time.perf_counter() - self._last_plain >= self.PLAIN_EVERY_S or step == self.total:
            self._last_plain = time.perf_counter()
            print(f"step {step}/{self.total} | {fields}", flush=True)

    def write(self, line):
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def save_loss_plot(path, history, title):
    """A PNG of the training loss (per step) and validation loss; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(8, 4.5))
    if history["train"]:
        steps, losses = zip(*[(row[0], row[1]) for row in history["train"]])
        ax.plot(steps, losses, lw=0.8, alpha=0.6, label="train")
    if history["val"]:
        steps, losses = zip(*history["val"])
        ax.plot(steps, losses, marker="o", ms=3, label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / token)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    write_atomic(path, lambda f: f.write(buffer.getvalue()))
    return True
