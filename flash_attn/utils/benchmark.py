"""Timing helpers with flash-attn's signatures: forward, backward, both, a profiler and peak memory.

On a GPU each run is bracketed by a pair of CUDA events (after a synchronise and a short warm-up),
so the times are device times and no host sync sits between runs; on a machine without CUDA,
time.perf_counter times each call. Each benchmark returns (timer, measurement); measurement.mean
and .median are seconds, as in torch.utils.benchmark, and .times holds the per-run seconds.
"""

import statistics
import time

import torch


class Measurement:
    """Per-run times in seconds."""

    number_per_run = 1

    def __init__(self, times, desc=""):
        self.times = list(times)
        self.desc = desc

    @property
    def mean(self):
        return statistics.fmean(self.times)

    @property
    def median(self):
        return statistics.median(self.times)

    def __repr__(self):
        return (f"{self.desc}: median {self.median * 1e3:.3f} ms, mean {self.mean * 1e3:.3f} ms "
                f"({len(self.times)} runs)")


class Timer:
    """Calls stmt() `warmup` times untimed, then times `number` calls one by one."""

    warmup = 2

    def __init__(self, stmt, desc="", use_cuda=None):
        self.stmt = stmt
        self.desc = desc
        self.use_cuda = torch.cuda.is_available() if use_cuda is None else use_cuda

    def timeit(self, number):
        for _ in range(self.warmup):
            self.stmt()
        if not self.use_cuda:
            times = []
            for _ in range(number):
                start = time.perf_counter()
                self.stmt()
                times.append(time.perf_counter() - start)
            return Measurement(times, self.desc)
        torch.cuda.synchronize()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(number)]
        for start, end in events:
            start.record()
            self.stmt()
            end.record()
        torch.cuda.synchronize()
        return Measurement([start.elapsed_time(end) / 1e3 for start, end in events], self.desc)


def _autocast_device(inputs, kwinputs):
    """Where amp autocasts: the device type of the first tensor input (CPU tensors on a GPU
    machine too); without one (fn closes over its tensors), CUDA when available, else the CPU."""
    for t in (*inputs, *kwinputs.values()):
        if isinstance(t, torch.Tensor) and torch.amp.is_autocast_available(t.device.type):
            return t.device.type
    return "cuda" if torch.cuda.is_available() else "cpu"


def _autocast(amp, amp_dtype, device_type):
    return torch.autocast(device_type=device_type, dtype=amp_dtype, enabled=amp)


def _first_output(y):
    return y[0] if isinstance(y, tuple) else y


def _clear_grads(inputs):
    for x in inputs:
        if isinstance(x, torch.Tensor):
            x.grad = None


def _output_grad(y, grad):
    if grad is None:
        return torch.randn_like(y)
    if grad.shape != y.shape:
        raise ValueError(f"grad: expected shape {tuple(y.shape)}, got {tuple(grad.shape)}")
    return grad


def _run(desc, what, stmt, repeats, verbose):
    timer = Timer(stmt, desc=f"{desc} - {what}" if desc else what)
    measurement = timer.timeit(repeats)
    if verbose:
        print(measurement)
    return timer, measurement


def benchmark_forward(fn, *inputs, repeats=10, desc="", verbose=True, amp=False,
                      amp_dtype=torch.float16, **kwinputs):
    """Times fn(*inputs, **kwinputs)."""
    device = _autocast_device(inputs, kwinputs)

    def forward():
        with _autocast(amp, amp_dtype, device):
            fn(*inputs, **kwinputs)

    return _run(desc, "Forward pass", forward, repeats, verbose)


def benchmark_backward(fn, *inputs, grad=None, repeats=10, desc="", verbose=True, amp=False,
                       amp_dtype=torch.float16, **kwinputs):
    """Times the backward of one forward's output (the first element if fn returns a tuple); the
    graph is kept between runs and the inputs' .grad cleared before each."""
    device = _autocast_device(inputs, kwinputs)
    with _autocast(amp, amp_dtype, device):
        y = _first_output(fn(*inputs, **kwinputs))
    grad = _output_grad(y, grad)

    def backward():
        _clear_grads(inputs)
        y.backward(grad, retain_graph=True)

    return _run(desc, "Backward pass", backward, repeats, verbose)


def benchmark_combined(fn, *inputs, grad=None, repeats=10, desc="", verbose=True, amp=False,
                       amp_dtype=torch.float16, **kwinputs):
    """Times forward + backward together."""
    device = _autocast_device(inputs, kwinputs)
    if grad is None:
        with _autocast(amp, amp_dtype, device):
            grad = torch.randn_like(_first_output(fn(*inputs, **kwinputs)))

    def forward_backward():
        _clear_grads(inputs)
        with _autocast(amp, amp_dtype, device):
            y = _first_output(fn(*inputs, **kwinputs))
        y.backward(_output_grad(y, grad))

    return _run(desc, "Forward + Backward pass", forward_backward, repeats, verbose)


def benchmark_fwd_bwd(fn, *inputs, grad=None, repeats=10, desc="", verbose=True, amp=False,
                      amp_dtype=torch.float16, **kwinputs):
    """(benchmark_forward(...), benchmark_backward(...))."""
    return (
        benchmark_forward(fn, *inputs, repeats=repeats, desc=desc, verbose=verbose, amp=amp,
                          amp_dtype=amp_dtype, **kwinputs),
        benchmark_backward(fn, *inputs, grad=grad, repeats=repeats, desc=desc, verbose=verbose,
                           amp=amp, amp_dtype=amp_dtype, **kwinputs),
    )


def benchmark_all(fn, *inputs, grad=None, repeats=10, desc="", verbose=True, amp=False,
                  amp_dtype=torch.float16, **kwinputs):
    """(forward, backward, combined), each a (timer, measurement) pair."""
    return benchmark_fwd_bwd(fn, *inputs, grad=grad, repeats=repeats, desc=desc, verbose=verbose,
                             amp=amp, amp_dtype=amp_dtype, **kwinputs) + (
        benchmark_combined(fn, *inputs, grad=grad, repeats=repeats, desc=desc, verbose=verbose,
                           amp=amp, amp_dtype=amp_dtype, **kwinputs),
    )


_PROFILER_WARMUP = 30  # enough for lazy initialisation and autotuning to finish first


def pytorch_profiler(fn, *inputs, trace_filename=None, backward=False, amp=False,
                     amp_dtype=torch.float16, cpu=False, verbose=True, **kwinputs):
    """Profiles one call (forward, plus backward if asked) after warm-up; prints the op table
    when verbose and writes a Chrome trace to trace_filename if given. Returns the profiler.
    CUDA activity is recorded when CUDA is available, CPU activity when cpu=True (or without
    CUDA, where it is all there is)."""
    device = _autocast_device(inputs, kwinputs)
    grad = None
    if backward:
        with _autocast(amp, amp_dtype, device):
            grad = torch.randn_like(_first_output(fn(*inputs, **kwinputs)))

    def step():
        if backward:
            _clear_grads(inputs)
        with _autocast(amp, amp_dtype, device):
            y = _first_output(fn(*inputs, **kwinputs))
        if backward:
            y.backward(grad)

    for _ in range(_PROFILER_WARMUP):
        step()
    activities = []
    if cpu or not torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CPU)
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
        step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    if verbose:
        sort_by = ("self_device_time_total" if torch.cuda.is_available()
                   else "self_cpu_time_total")
        print(prof.key_averages().table(sort_by=sort_by, row_limit=50))
    if trace_filename is not None:
        prof.export_chrome_trace(str(trace_filename))
    return prof


def benchmark_memory(fn, *inputs, desc="", verbose=True, **kwinputs):
    """Peak GiB that one call of fn allocates on the current CUDA device beyond what was already
    allocated. CUDA only: the caching allocator's counters are what is measured."""
    if not torch.cuda.is_available():
        raise RuntimeError("benchmark_memory: expected a CUDA device (it reads the CUDA caching "
                           "allocator's peak counters)")
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    baseline = torch.cuda.memory_allocated()
    fn(*inputs, **kwinputs)
    torch.cuda.synchronize()
    mem = (torch.cuda.max_memory_allocated() - baseline) / 2**30
    if verbose:
        print(f"{desc} max memory: {mem:.4f} GiB")
    torch.cuda.empty_cache()
    return mem
