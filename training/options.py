"""The command line: every option, its default for the machine the run is on, and the checks
that reject a run before anything is trained.

An option left out takes, in this order: its value in the checkpoint being resumed (--resume),
else the profile of the device (PROFILES: a small model on CPU, GPT-2 small on a GPU), else
COMMON. So `python training/train.py` needs no arguments, and `--resume` alone continues a run
with the settings it was started with.
"""

import argparse
import tempfile
from pathlib import Path

import torch

from flash_attn.models.presets import PRESETS

COMMON = dict(data=None, vocab_size=None, dropout=0.0, min_lr_ratio=0.1, weight_decay=0.1,
              grad_clip=1.0, keep_checkpoints=2, out="out", seed=0, parallel="ddp",
              sample_tokens=256, peak_tflops=None, n_layer=None, n_embd=None, n_head=None,
              n_head_kv=None, loss="logits")

# The CPU profile is sized to finish in a few minutes on two cores with the validation loss well
# down (the README's "Training a GPT" gives the measured time); the GPU one trains GPT-2 small.
PROFILES = {
    "cpu": dict(preset="gpt-mini", seqlen=128, batch_size=16, grad_accum=1, steps=1000,
                lr=2e-3, warmup=50, eval_every=100, eval_batches=4, checkpoint_every=250),
    "cuda": dict(preset="gpt2-small", seqlen=1024, batch_size=16, grad_accum=4, steps=2000,
                 lr=6e-4, warmup=100, eval_every=200, eval_batches=20, checkpoint_every=500),
}

# What shapes the model and the reading order: fixed once a run has started.
RUN_SHAPING = ("preset", "n_layer", "n_embd", "n_head", "n_head_kv", "seqlen", "vocab_size",
               "seed")


class UsageError(ValueError):
    """An option (or combination) the run cannot start with; the message names the options."""


def _int_at_least(minimum):
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
        return value
    parse.metavar = "N"
    return parse


def _float_in(low, high=None, low_open=False):
    def parse(text):
        try:
            value = float(text)
        except ValueError:
            value = None
        ok = value is not None and (value > low if low_open else value >= low) and (
            high is None or value <= high)
        if not ok:
            bound = f"{'>' if low_open else '>='} {low}" + (f" and <= {high}" if high else "")
            raise argparse.ArgumentTypeError(f"expected a number {bound}, got {text!r}")
        return value
    parse.metavar = "X"
    return parse


def _default(dest):
    """' (default: ...)' for the help text, from COMMON or the profiles."""
    if dest in COMMON:
        return "" if COMMON[dest] is None else f" (default: {COMMON[dest]})"
    if dest in PROFILES["cpu"]:
        return f" (default: {PROFILES['cpu'][dest]} on CPU, {PROFILES['cuda'][dest]} on a GPU)"
    return ""


def _add(group, flag, help, parse=None, **kwargs):
    """An option whose help ends with its default; parse: a checked int or float parser."""
    dest = flag[2:].replace("-", "_")
    if parse is not None:
        kwargs.update(type=parse, metavar=parse.metavar)
    group.add_argument(flag, help=help + _default(dest), **kwargs)


def build_parser():
    p = argparse.ArgumentParser(
        prog="train.py", allow_abbrev=False,
        description="Train a GPT (flash_attn.models.gpt.GPTLMHeadModel). With no arguments: "
                    "the Python standard library's sources as bytes, a model sized for this "
                    "machine.",
        epilog="Several processes: torchrun --nproc_per_node N training/train.py "
               "[--parallel ddp|fsdp] (also across nodes, through torchrun's rendezvous).")
    positive, count = _int_at_least(1), _int_at_least(0)
    data = p.add_argument_group("data")
    _add(data, "--data", "a text file, a folder of text files or a uint16 .bin file of token "
                         "ids (nanoGPT's format; train.bin uses the val.bin beside it) "
                         "(default: the Python standard library)", metavar="PATH")
    _add(data, "--vocab-size", "the vocabulary of a .bin file (default: its largest id + 1)",
         positive)
    model = p.add_argument_group("model")
    _add(model, "--preset", "model shape", choices=list(PRESETS))
    for flag, what in (("--n-layer", "blocks"), ("--n-embd", "width"),
                       ("--n-head", "query heads"),
                       ("--n-head-kv", "key/value heads (grouped-query attention)")):
        _add(model, flag, f"{what} (default: the preset's)", positive)
    _add(model, "--dropout", "dropout", _float_in(0.0, 0.99))
    _add(model, "--seqlen", "tokens per sequence", positive)
    opt = p.add_argument_group("optimisation")
    _add(opt, "--batch-size", "sequences per micro-batch and process", positive)
    _add(opt, "--grad-accum", "micro-batches per step", positive)
    _add(opt, "--steps", "optimizer steps", positive)
    _add(opt, "--lr", "peak learning rate", _float_in(0.0, low_open=True))
    _add(opt, "--min-lr-ratio", "final learning rate / peak", _float_in(0.0, 1.0))
    _add(opt, "--warmup", "linear warm-up steps, then cosine decay", count)
    _add(opt, "--weight-decay", "AdamW weight decay of the matrices", _float_in(0.0))
    _add(opt, "--grad-clip", "max gradient norm, 0 = no clipping", _float_in(0.0))
    _add(opt, "--seed", "seed of the weights and the data order", count)
    _add(opt, "--loss", "logits: the LM head's logits, then cross-entropy; chunked: "
                        "losses.linear_cross_entropy, which never holds the full logits",
         choices=["logits", "chunked"])
    run = p.add_argument_group("run")
    _add(run, "--out", "output folder: checkpoints/, metrics.json, loss.png, sample.txt",
         metavar="DIR")
    run.add_argument("--resume", action="store_true",
                     help="continue from the latest checkpoint in --out")
    _add(run, "--eval-every", "steps between validations", positive)
    _add(run, "--eval-batches", "validation batches", positive)
    _add(run, "--checkpoint-every", "steps between checkpoints (one is also written at the end)",
         positive)
    _add(run, "--keep-checkpoints", "how many of the latest checkpoints to keep", positive)
    _add(run, "--sample-tokens", "tokens of text generated at the end", count)
    _add(run, "--device", "cpu or cuda (default: cuda when there is a GPU)", metavar="DEVICE")
    _add(run, "--parallel", "with several processes: DistributedDataParallel or FSDP2 "
                            "(fully_shard)", choices=["ddp", "fsdp"])
    _add(run, "--peak-tflops", "the device's peak TFLOP/s for MFU (default: a known GPU's bf16 "
                               "peak, else a measured matmul rate)",
         _float_in(0.0, low_open=True))
    return p


def explicit_options(argv):
    """{option: value} of the options given on the command line (argparse errors exit 2)."""
    args = build_parser().parse_args(argv)
    return {k: v for k, v in vars(args).items() if v is not None and k != "resume"}, args.resume


def default_device():
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve(explicit, saved=None):
    """The run's settings (a Namespace): explicit options over the resumed run's (saved) or
    the device profile's. Checks what a resumed run may not change."""
    device = explicit.get("device", default_device())
    try:
        kind = torch.device(device).type
    except RuntimeError as error:
        raise UsageError(f"--device {device!r}: {error}") from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {device}: CUDA is not available on this machine")
    if saved is None:
        settings = {**COMMON, **PROFILES["cuda" if kind == "cuda" else "cpu"]}
    else:
        # A run saved before an option existed takes that option's common default.
        settings = {**COMMON, **saved}
        changed = [f"--{k.replace('_', '-')} {saved.get(k)} -> {explicit[k]}"
                   for k in RUN_SHAPING if k in explicit and explicit[k] != saved.get(k)]
        if changed:
            raise UsageError("--resume continues a run with its model, data order and seed; "
                             f"these differ from the checkpoint's: {', '.join(changed)}")
    settings.update(explicit)
    settings["device"] = device
    return argparse.Namespace(**settings)


def check_out(out):
    """--out must be a folder this process can write in (created if missing)."""
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".write-test-"):
            pass
    except FileExistsError:
        raise UsageError(f"--out {out}: exists and is not a folder") from None
    except OSError as error:
        raise UsageError(f"--out {out}: cannot write there ({error.strerror or error})") from None
