import json
import time

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
