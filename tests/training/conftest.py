"""What the training tests share: the repository root on sys.path (training/ is not an installed
package), a small text corpus, tiny-model arguments, and running training/train.py in fresh
processes (plain, or under torchrun with gloo)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "training" / "train.py"
sys.path.insert(0, str(REPO))

# A model that trains in milliseconds a step; the options every end-to-end test shares.
TINY = ["--preset", "gpt-mini", "--n-layer", "2", "--n-embd", "32", "--n-head", "2",
        "--seqlen", "16", "--lr", "3e-3", "--warmup", "2", "--eval-batches", "2",
        "--sample-tokens", "8", "--device", "cpu"]
RUN_TIMEOUT_S = 300  # each run takes seconds; the margin is for a loaded 2-core machine


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory):
    """A folder of real text files (copies of standard-library sources): split by file."""
    import email

    folder = tmp_path_factory.mktemp("corpus")
    for source in sorted(Path(email.__file__).parent.glob("*.py")):
        (folder / source.name).write_bytes(source.read_bytes())
    return folder


def train_env():
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def train_command(nproc=1):
    if nproc == 1:
        return [sys.executable, str(TRAIN)]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={nproc}", str(TRAIN)]


def _run_train(args, nproc=1, timeout=RUN_TIMEOUT_S):
    """training/train.py with args, in one process or under torchrun with nproc; the
    CompletedProcess (stdout and stderr together), asserting that it succeeded."""
    proc = subprocess.run(train_command(nproc) + [str(a) for a in args], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout, env=train_env(),
                          cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-6000:]
    return proc


def _metrics(out):
    return json.loads((Path(out) / "metrics.json").read_text())


@pytest.fixture(scope="session")
def run_train():
    return _run_train


@pytest.fixture(scope="session")
def start_train():
    """args -> a Popen of training/train.py (one process), stdout and stderr in one text pipe."""
    def start(args):
        return subprocess.Popen(train_command() + [str(a) for a in args], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env=train_env(), cwd=REPO)
    return start


@pytest.fixture(scope="session")
def read_metrics():
    """out -> metrics.json's content (history: train [step, loss, lr, grad norm], val [step,
    loss])."""
    return _metrics


@pytest.fixture(scope="session")
def tiny():
    return list(TINY)
