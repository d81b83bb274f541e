"""What the training tests share: the repository root on sys.path (training/ is not an installed
package), a small text corpus, tiny-model arguments, and running training/train.py in fresh
processes (plain, or under torchrun with gloo)."""

import json
import os
import signal
import subprocess
import sys
import time
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
    # faulthandler: a process sent SIGABRT prints every thread's Python stack (see _stop_hung).
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1")
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def train_command(nproc=1):
    if nproc == 1:
        return [sys.executable, str(TRAIN)]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={nproc}", str(TRAIN)]


def _descendants(pid):
    """Every process below pid (torchrun starts its workers in sessions of their own, so a
    kill of torchrun alone leaves them running)."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if parent == pid:
            children.append(int(stat.parent.name))
    return children + [d for child in children for d in _descendants(child)]


def _stop_hung(proc):
    """Where a run that stopped making progress is stuck: SIGABRT to every process of it (each
    prints its threads' Python stacks), then SIGKILL to what is left; the output."""
    tree = _descendants(proc.pid) + [proc.pid]
    for signal_number, wait_s in ((signal.SIGABRT, 10), (signal.SIGKILL, 0)):
        for pid in tree:
            try:
                os.kill(pid, signal_number)
            except ProcessLookupError:
                pass
        time.sleep(wait_s)
    output, _ = proc.communicate()
    return output


def _run_train(args, nproc=1, timeout=RUN_TIMEOUT_S):
    """training/train.py with args, in one process or under torchrun with nproc; the
    CompletedProcess (stdout and stderr together), asserting that it succeeded in time."""
    command = train_command(nproc) + [str(a) for a in args]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=train_env(), cwd=REPO) as proc:
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            output = _stop_hung(proc)
            pytest.fail(f"train.py did not end in {timeout} s; its output, with the stacks of "
                        f"its processes at the end:\n{output[-12000:]}")
    assert proc.returncode == 0, output[-6000:]
    return subprocess.CompletedProcess(command, proc.returncode, output)


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
