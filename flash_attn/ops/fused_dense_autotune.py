"""FusedMLP's heuristic="auto": which cuBLASLt candidate (or the unfused path) runs each step,
measured once per problem and cached.

A problem is (rows, in_features, hidden, out_features, dtype, device, activation, has_bias1,
has_bias2, training). For it, the forward GEMM + activation of every candidate is timed; in
training also the two weight gradients (BGRADB GEMM or PyTorch's mm + sum), then the activation's
gradient with the first GEMM's weight gradient of every candidate. Ties (within _TIE_MARGIN) go to
what heuristic=-1 runs. In training the stages' choices must then beat the unfused plan as a whole
forward + backward step too. Candidates are timed in interleaved rounds with the L2 cache flushed before
each call. The plan is a (forward, backward, wgrad) triple as FusedMLPFunc takes it.

The steps being timed are flash_attn.ops.fused_dense's own (_act_forward, _act_backward, _wgrad),
reached through that module at tuning time: it imports this one, so this one cannot import it
at the top.
"""

import contextlib
import functools

import torch

# problem key (see plan_for) -> (fwd, bwd, wgrad). Read by benchmarks and scripts.
AUTO_PLANS = {}
_TIE_MARGIN = 1.01  # a candidate must beat the default by more than timing noise to be chosen
_UNFUSED = (-1, -1, -1)  # PyTorch's ops for every stage
_L2_FLUSH_BYTES = 256 << 20  # more than any GPU's L2 (H100/H200: 50-60 MB), as triton's do_bench flushes
# GPU clock cycles the stream waits before each timed call (about 2 ms on an H200): longer than the
# host takes to launch a whole MLP step, so the call's kernels run back to back.
_HEAD_START_CYCLES = 4_000_000


def _time_candidates(fns, warmup=2, rounds=7, gpu_time=True):
    """{key: median milliseconds of fn()} for fns {key: fn}, on the current CUDA stream. Measured in
    interleaved rounds (one call of each candidate per round), so that clock changes during the
    search touch every candidate alike rather than favouring the ones timed last; the L2 cache is
    flushed before each call, since the operands of a layer come from memory, not from the L2.
    gpu_time: the stream waits (_HEAD_START_CYCLES) before each call while the host launches it,
    so the time is the kernels' alone, what a CUDA graph replay or a GPU-bound step pays. Without
    it a step whose launches take longer than its kernels is timed at the host's pace, which
    differs between plans by their launch counts and in noise (GPT-2 medium's MLP: 0.7 ms of
    kernels, 0.7-0.9 ms of launches), and the plan chosen under that noise then runs in graphs."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    flush = torch.empty(_L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    events = {key: [] for key in fns}
    for _ in range(rounds):
        for key, fn in fns.items():
            flush.zero_()
            if gpu_time:
                torch.cuda._sleep(_HEAD_START_CYCLES)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            events[key].append((start, end))
    torch.cuda.synchronize()
    medians = {}
    for key, pairs in events.items():
        times = sorted(start.elapsed_time(end) for start, end in pairs)
        medians[key] = times[len(times) // 2]
    return medians


def _fastest(times, default=-1):
    best = min(times, key=times.get)
    return default if times[default] <= times[best] * _TIE_MARGIN else best


def _tune_mlp(batch_dim, in_features, hidden, out_features, dtype, device, activation, has_bias1, has_bias2,
              training):
    """The plan of one problem, timed on random data of its shape."""
    from flash_attn.ops import fused_dense as fd  # see the module docstring

    ext, is_gelu = fd._ext(), activation == "gelu_approx"
    device_ctx = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with device_ctx, torch.no_grad(), torch.autocast(device.type, enabled=False):
        x = torch.randn(batch_dim, in_features, device=device, dtype=dtype)
        w1 = torch.randn(hidden, in_features, device=device, dtype=dtype) * in_features ** -0.5
        b1 = torch.randn(hidden, device=device, dtype=dtype) if has_bias1 else None
        n_fwd = min(ext.linear_act_forward_num_algos(x, w1, b1, is_gelu, training), ext.max_heuristic_algos)
        fwd_times = _time_candidates({h: functools.partial(fd._act_forward, x, w1, b1, activation, h, training)
                                      for h in range(-1, n_fwd)})
        fwd = _fastest(fwd_times)
        if not training:
            return fwd, -1, 0
        w2 = torch.randn(out_features, hidden, device=device, dtype=dtype) * hidden ** -0.5
        grad = torch.randn(batch_dim, out_features, device=device, dtype=dtype)
        grad_pre_act = torch.randn(batch_dim, hidden, device=device, dtype=dtype)
        output1, pre_act = fd._act_forward(x, w1, b1, activation, -1, True)
        fused_act_input = pre_act if is_gelu else ext.linear_act_forward(x, w1, b1, False, True, 0)[1]

        def wgrads(mode):
            fd._wgrad(output1, grad, has_bias2, mode >= 0)
            fd._wgrad(x, grad_pre_act, has_bias1, mode >= 0)

        wgrad = _fastest(_time_candidates({mode: functools.partial(wgrads, mode) for mode in (-1, 0)}), default=0)

        def backward(h):
            grad_pre_act = fd._act_backward(grad, w2, fused_act_input if h >= 0 else pre_act, output1, activation,
                                            h)
            fd._wgrad(x, grad_pre_act, has_bias1, wgrad >= 0)

        n_bwd = min(ext.act_linear_dgrad_num_algos(w2, grad, fused_act_input, is_gelu), ext.max_heuristic_algos)
        bwd_times = _time_candidates({h: functools.partial(backward, h) for h in range(-1, n_bwd)})
        bwd = _fastest(bwd_times)
    if activation == "relu" and fwd < 0 <= bwd:
        # The fused ReLU backward needs the fused forward's bit-mask: compare the two pairings.
        fused_fwd = min((h for h in fwd_times if h >= 0), key=fwd_times.get)
        if fwd_times[fused_fwd] + bwd_times[bwd] < (fwd_times[-1] + bwd_times[-1]) / _TIE_MARGIN:
            fwd = fused_fwd
        else:
            bwd = -1
    plan = (fwd, bwd, wgrad)
    if plan == _UNFUSED:
        return plan
    # Stage times do not add up exactly (a stage's output is the next one's input, in the L2 or
    # not): the plan must also win as a whole MLP step, else the unfused one runs.
    b2 = torch.zeros(out_features, device=device, dtype=dtype) if has_bias2 else None
    leaves = [t.requires_grad_(True) for t in (x, w1, b1, w2, b2) if t is not None]

    def whole_step(plan):
        with torch.enable_grad():
            fd.FusedMLPFunc.apply(x, w1, b1, w2, b2, activation, True, False, 0, plan, None, False).backward(grad)
        for t in leaves:
            t.grad = None

    with device_ctx, torch.autocast(device.type, enabled=False):
        whole = _time_candidates({candidate: functools.partial(whole_step, candidate) for candidate in (_UNFUSED, plan)})
    return _fastest(whole, default=_UNFUSED)


def plan_for(x, weight1, weight2, bias1, bias2, dtype, activation, save_pre_act, process_group,
             sequence_parallel):
    """The (fwd, bwd, wgrad) plan of this call: cached, or measured now. dtype: what the layer
    computes in (autocast's, or x's). -1 (unfused) for sqrelu. While torch.compile traces or a
    CUDA graph captures, nothing can be timed: the cached plan (from the warm-up steps that
    precede a capture), or -1 when the problem was never tuned."""
    if activation == "sqrelu":
        return -1
    batch_dim = x.numel() // x.shape[-1]
    if process_group is not None and sequence_parallel:
        batch_dim *= torch.distributed.get_world_size(process_group)
    key = (batch_dim, x.shape[-1], weight1.shape[0], weight2.shape[0], dtype, x.device, activation,
           bias1 is not None, bias2 is not None, bool(save_pre_act))
    plan = AUTO_PLANS.get(key)
    if plan is not None:
        return plan
    if torch.compiler.is_compiling() or (x.is_cuda and torch.cuda.is_current_stream_capturing()):
        return -1
    plan = AUTO_PLANS[key] = _tune_mlp(*key)
    return plan
