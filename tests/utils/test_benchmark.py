import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from flash_attn.utils.benchmark import (
    Measurement,
    Timer,
    benchmark_all,
    benchmark_backward,
    benchmark_combined,
    benchmark_forward,
    benchmark_fwd_bwd,
    benchmark_memory,
    pytorch_profiler,
)


class Counted(torch.autograd.Function):
    """y = 3 * x, counting forward and backward calls."""

    calls = {"forward": 0, "backward": 0}

    @staticmethod
    def forward(ctx, x):
        Counted.calls["forward"] += 1
        return 3.0 * x

    @staticmethod
    def backward(ctx, grad):
        Counted.calls["backward"] += 1
        return 3.0 * grad


@pytest.fixture
def counted():
    Counted.calls.update(forward=0, backward=0)
    return Counted.calls


def test_measurement_statistics():
    m = Measurement([0.003, 0.001, 0.002, 0.010])
    assert m.mean == pytest.approx(0.004) and m.median == pytest.approx(0.0025)
    assert m.times == [0.003, 0.001, 0.002, 0.010]


def test_forward_runs_repeats_times_and_passes_arguments():
    seen = []

    def fn(x, scale=1.0):
        seen.append((x, scale))

    x = torch.ones(2)
    timer, m = benchmark_forward(fn, x, repeats=7, verbose=False, scale=2.0)
    assert isinstance(timer, Timer) and isinstance(m, Measurement)
    assert len(seen) == 7 + timer.warmup and len(m.times) == 7
    assert all(a is x and s == 2.0 for a, s in seen)
    assert all(t > 0 for t in m.times) and 0 < m.median <= max(m.times) and m.mean > 0


def test_forward_timing_is_in_seconds():
    _, m = benchmark_forward(time.sleep, 0.005, repeats=3, verbose=False)
    assert 0.005 <= m.median < 0.5 and 0.005 <= m.mean < 0.5


def test_backward_runs_backward_only_and_clears_grads(counted):
    x = torch.randn(4, 5, requires_grad=True)
    grad = torch.randn(4, 5)
    timer, m = benchmark_backward(Counted.apply, x, grad=grad, repeats=5, verbose=False)
    assert counted == {"forward": 1, "backward": 5 + timer.warmup}
    assert len(m.times) == 5 and all(t > 0 for t in m.times)
    # Cleared before every run: the gradient is one backward's, not an accumulation.
    torch.testing.assert_close(x.grad, 3.0 * grad)
    with pytest.raises(ValueError, match="grad"):
        benchmark_backward(Counted.apply, x, grad=torch.randn(3), verbose=False)


def test_backward_uses_first_output_of_a_tuple(counted):
    x = torch.randn(3, requires_grad=True)
    benchmark_backward(lambda t: (Counted.apply(t), "extra"), x, repeats=2, verbose=False)
    assert counted["backward"] == 2 + Timer.warmup and x.grad is not None


def test_combined_runs_forward_and_backward_each_time(counted):
    x = torch.randn(6, requires_grad=True)
    timer, m = benchmark_combined(Counted.apply, x, grad=torch.ones(6), repeats=4, verbose=False)
    assert counted == {"forward": 4 + timer.warmup, "backward": 4 + timer.warmup}
    torch.testing.assert_close(x.grad, torch.full((6,), 3.0))
    assert len(m.times) == 4 and m.mean > 0


def test_fwd_bwd_and_all_return_timer_measurement_pairs(counted, capsys):
    x = torch.randn(6, requires_grad=True)
    pairs = benchmark_fwd_bwd(Counted.apply, x, repeats=3, desc="lin")
    assert len(pairs) == 2
    pairs = benchmark_all(Counted.apply, x, repeats=3, desc="lin")
    assert len(pairs) == 3
    for timer, m in pairs:
        assert isinstance(timer, Timer) and len(m.times) == 3
    printed = capsys.readouterr().out
    for what in ("Forward pass", "Backward pass", "Forward + Backward pass"):
        assert f"lin - {what}" in printed


def test_amp_enables_autocast():
    dtypes = []

    def fn(a, b):
        dtypes.append((a @ b).dtype)

    a = torch.randn(4, 4)
    benchmark_forward(fn, a, a, repeats=1, verbose=False, amp=True, amp_dtype=torch.bfloat16)
    benchmark_forward(fn, a, a, repeats=1, verbose=False)
    assert set(dtypes[:1 + Timer.warmup]) == {torch.bfloat16}
    assert set(dtypes[1 + Timer.warmup:]) == {torch.float32}


def test_amp_autocasts_on_the_device_of_keyword_inputs():
    # The autocast device comes from the tensor inputs, keyword ones included: CPU tensors are
    # autocast on the CPU also where CUDA is available.
    dtypes = []

    def fn(a=None, b=None):
        dtypes.append((a @ b).dtype)

    a = torch.randn(4, 4)
    benchmark_forward(fn, a=a, b=a, repeats=1, verbose=False, amp=True, amp_dtype=torch.bfloat16)
    assert set(dtypes) == {torch.bfloat16}


def test_pytorch_profiler_writes_trace(tmp_path, capsys):
    calls = []

    def fn(a, b):
        calls.append(1)
        return a @ b

    a = torch.randn(8, 8, requires_grad=True)
    trace = tmp_path / "trace.json"
    prof = pytorch_profiler(fn, a, a, trace_filename=trace, backward=True, cpu=True)
    names = {e.key for e in prof.key_averages()}
    assert any("mm" in n for n in names)
    assert any("Backward" in n for n in names)  # the backward pass was profiled
    assert len(calls) >= 2 and a.grad is not None
    events = json.loads(trace.read_text())["traceEvents"]
    assert any("mm" in e.get("name", "") for e in events)
    assert "mm" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_benchmark_memory_needs_cuda():
    with pytest.raises(RuntimeError, match="CUDA"):
        benchmark_memory(lambda: None)


@pytest.mark.gpu
def test_benchmark_memory_measures_peak_allocation():
    def fn():
        t = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")  # 0.25 GiB
        del t

    mem = benchmark_memory(fn, verbose=False)
    assert 0.25 <= mem < 0.26


@pytest.mark.gpu
def test_cuda_events_measure_device_time():
    # Twice the spin cycles should take about twice the device time, whatever the launch cost.
    timer, short = benchmark_forward(torch.cuda._sleep, 2_000_000, repeats=5, verbose=False)
    _, long = benchmark_forward(torch.cuda._sleep, 4_000_000, repeats=5, verbose=False)
    assert timer.use_cuda and short.median > 0
    assert 1.6 < long.median / short.median < 2.4


# ----------------------------------------------------------------------------------------------
# The benchmark scripts (benchmarks/): --smoke runs on CPU and writes nothing into benchmarks/;
# without --smoke and without CUDA every script exits the same way.
# ----------------------------------------------------------------------------------------------

REPO = Path(__file__).resolve().parents[2]
BENCH_DIR = REPO / "benchmarks"
SCRIPTS = sorted(p.name for p in BENCH_DIR.glob("benchmark_*.py"))
# Scripts whose "ours" needs CUDA kernels: their smoke runs must say what stands in for it.
STAND_IN_SCRIPTS = {"benchmark_flash_attention.py", "benchmark_fused_dense.py",
                    "benchmark_layer_norm.py", "benchmark_gpt.py", "benchmark_kvcache.py",
                    "benchmark_score_mods.py"}
SCRIPT_TIMEOUT_S = 300  # a smoke run takes seconds; the margin is for a loaded 2-core machine
TABLE = re.compile(r"^## .+\n\|( .+ \|)+\n\|(---\|)+$", re.M)


def _load_common():
    """A fresh benchmarks/_common.py (its smoke decision is module state), loaded without writing
    benchmarks/__pycache__."""
    spec = importlib.util.spec_from_file_location("benchmarks_common", BENCH_DIR / "_common.py")
    module = importlib.util.module_from_spec(spec)
    dont_write_bytecode, sys.dont_write_bytecode = sys.dont_write_bytecode, True
    try:
        spec.loader.exec_module(module)
    finally:
        sys.dont_write_bytecode = dont_write_bytecode
    return module


@pytest.fixture
def common(monkeypatch, tmp_path):
    monkeypatch.delenv("FLASH_ATTN_BENCH_OUT", raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "0"))  # restored after
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where a smoke run's folder goes
    threads = torch.get_num_threads()  # parse_args(--smoke) sets one thread for the process
    yield _load_common()
    torch.set_num_threads(threads)


def _bench_dir_state():
    """Bytes and mtime of the tracked results (RESULTS.md, PNGs), and every file name under
    benchmarks/ but Python's bytecode cache."""
    tracked = {p.name: (p.read_bytes(), p.stat().st_mtime_ns)
               for p in [BENCH_DIR / "RESULTS.md", *BENCH_DIR.glob("*.png")]}
    names = sorted(str(p.relative_to(BENCH_DIR)) for p in BENCH_DIR.rglob("*")
                   if "__pycache__" not in p.parts)
    return tracked, names


def _run_script(script, args, tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k not in ("FLASH_ATTN_BENCH_OUT", "TRITON_INTERPRET")}  # the script must set it
    env.update(PYTHONDONTWRITEBYTECODE="1", TMPDIR=str(tmp_path))
    return subprocess.run([sys.executable, str(BENCH_DIR / script), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=SCRIPT_TIMEOUT_S)


def test_every_benchmark_script_is_covered():
    assert {"benchmark_flash_attention.py", "benchmark_fused_dense.py", "benchmark_layer_norm.py",
            "benchmark_rotary.py", "benchmark_cross_entropy.py", "benchmark_gpt.py"} <= set(SCRIPTS)


def test_waiting_kernel_variants_apply_to_head():
    """Each kernel variant in benchmarks/variants waits for a GPU session as a patch against the
    current tree: one that no longer applies could not be timed, so a change that breaks it must
    refresh it (or say the variant is dropped)."""
    patches = sorted((BENCH_DIR / "variants").glob("*.patch"))
    if not patches:
        pytest.skip("no kernel variant is waiting")
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs a git checkout")
    for patch in patches:
        result = subprocess.run(["git", "apply", "--check", str(patch)], cwd=REPO, capture_output=True, text=True)
        assert result.returncode == 0, f"{patch.name} no longer applies: {result.stderr.strip()}"


def _interpreter_too_old(script):
    """The Triton layer-norm backward and the Triton linear kernel loop over a range with tensor
    bounds, which the Triton interpreter runs from triton 3.9 (CPU CI's); older ones (3.6 beside
    torch 2.11) raise. On a GPU the compiled kernels run them (their GPU tests cover that)."""
    if script not in ("benchmark_layer_norm.py", "benchmark_triton_mlp.py"):
        return False
    import triton

    return tuple(int(p) for p in triton.__version__.split(".")[:2]) < (3, 9)


@pytest.mark.parametrize("script", SCRIPTS)
def test_benchmark_smoke_runs_on_cpu_and_leaves_benchmarks_alone(script, tmp_path):
    if _interpreter_too_old(script):
        pytest.skip(f"this Triton's interpreter cannot run {script}'s kernels (needs >= 3.9)")
    before = _bench_dir_state()
    proc = _run_script(script, ["--smoke"], tmp_path)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    assert TABLE.search(out), out[-3000:]
    assert _bench_dir_state() == before  # RESULTS.md and the PNGs byte-identical, nothing added
    # Results went to a fresh temporary folder, named in the output.
    folder = re.search(r"^smoke run: RESULTS\.md and plots go to (\S+) ", out, re.M)
    assert folder, out[-3000:]
    folder = Path(folder.group(1))
    assert folder.parent == tmp_path and folder.name.startswith("flash_attn_bench_smoke_")
    assert "smoke run (tiny shapes, CPU)" in (folder / "RESULTS.md").read_text()
    if importlib.util.find_spec("matplotlib") is not None:
        assert list(folder.glob("*.png")), out[-3000:]
    else:
        assert "matplotlib is not installed: no plot written" in out
    if script in STAND_IN_SCRIPTS:
        assert re.search(r"^smoke run: '[\w ]+' is ", out, re.M), out[:3000]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only exit")
@pytest.mark.parametrize("script", SCRIPTS)
def test_benchmark_without_smoke_exits_2_without_cuda(script, tmp_path):
    before = _bench_dir_state()
    proc = _run_script(script, [], tmp_path)
    bench_common = _load_common()
    assert proc.returncode == bench_common.NO_CUDA_EXIT_CODE == 2, proc.stdout + proc.stderr
    stderr_lines = proc.stderr.strip().splitlines()
    assert stderr_lines and stderr_lines[-1] == bench_common.no_cuda_message(script), proc.stderr
    assert proc.stdout == ""
    assert _bench_dir_state() == before


def test_parse_args_owns_smoke_and_script_options(common):
    def add_options(parser):
        parser.add_argument("--dims", default="64")

    args = common.parse_args("d", compile_option=True, add_options=add_options,
                             argv=["--smoke", "--dims", "16"])
    assert args.smoke and args.dims == "16" and not args.no_compile
    assert os.environ["TRITON_INTERPRET"] == "1" and torch.get_num_threads() == 1
    assert common.output_dir().name.startswith("flash_attn_bench_smoke_")
    with pytest.raises(SystemExit):
        common.parse_args("d", argv=["--smo"])  # no abbreviations: --smoke is spelt out


def test_no_cuda_exit_names_the_script_and_smoke(common, monkeypatch, capsys):
    monkeypatch.setattr(common.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", ["benchmarks/benchmark_x.py"])
    with pytest.raises(SystemExit) as exit_info:
        common.parse_args("d", argv=[])
    assert exit_info.value.code == 2
    message = capsys.readouterr().err.strip()
    assert message == common.no_cuda_message("benchmark_x.py")
    assert message.startswith("benchmark_x.py: needs a CUDA GPU") and "--smoke" in message
    monkeypatch.setattr(common.torch.cuda, "is_available", lambda: True)
    assert not common.parse_args("d", argv=[]).smoke  # with CUDA: a real run


def test_output_dir_real_run_smoke_run_and_explicit_folder(common, monkeypatch, tmp_path, capsys):
    assert common.output_dir() == BENCH_DIR  # before parse_args: a real run
    common.parse_args("d", argv=["--smoke"])
    smoke_dir = common.output_dir()
    assert smoke_dir.parent == tmp_path and smoke_dir.name.startswith("flash_attn_bench_smoke_")
    assert common.output_dir() == smoke_dir  # one folder per run, announced once
    assert capsys.readouterr().out.count(str(smoke_dir)) == 1
    explicit = tmp_path / "explicit"
    monkeypatch.setenv("FLASH_ATTN_BENCH_OUT", str(explicit))
    common.report("smoke table", ["a", "b"], [[1, 2.5]], notes="a note")
    written = (explicit / "RESULTS.md").read_text()
    assert "## smoke table" in written and "smoke run (tiny shapes, CPU)" in written
    assert "| 1 | 2.5 |" in written and "a note" in written
    assert "| 1 | 2.5 |" in capsys.readouterr().out


def test_smoke_save_plot_writes_into_the_smoke_folder(common):
    pytest.importorskip("matplotlib")
    before = _bench_dir_state()
    common.parse_args("d", argv=["--smoke"])
    common.save_plot("plot.png", "t", "x", "y", {"s": ([1, 2], [3.0, 4.0])}, xticks=[1, 2])
    assert (common.output_dir() / "plot.png").read_bytes().startswith(b"\x89PNG")
    assert _bench_dir_state() == before
