"""The plain-PyTorch attention that every kernel test and benchmark checks against, and that
the reference modules (flash_attn.modules.inner_attention.SelfAttention / CrossAttention) compute
with: one oracle for both.

Layout follows the kernels: q (b, s_q, h, d), k/v (b, s_k, h_k, d). Positions: query i of a
sequence with sq valid queries and sk valid keys lines up with key i + sk - sq (bottom-right
alignment), which is what causal, window_size and alibi all measure from. With padding masks,
sq and sk are per-batch valid lengths; with key_leftpad, keys before key_leftpad[b] are invalid
and key positions count from key_leftpad[b].

Also what kernel tests share beyond attention: the Triton interpreter's bfloat16 slack, rotary
tables, and run_distributed, which starts the ranks of every multi-process test.
"""

import math
import os

import torch

from flash_attn.bert_padding import pad_input, unpad_input


def _batch_view(x):
    """(b, ...) per-batch value -> (b, 1, 1, 1) for broadcasting over (b, h, s_q, s_k)."""
    return x.reshape(-1, 1, 1, 1)


def _geometry(seqlen_q, seqlen_k, query_padding_mask, key_padding_mask, key_leftpad, device):
    """Query rows, key positions, valid lengths and the keys cut off by key_leftpad, all shaped to
    broadcast against (b, h, s_q, s_k)."""
    if device is None:
        for t in (query_padding_mask, key_padding_mask, key_leftpad):
            if t is not None:
                device = t.device
                break
    row = torch.arange(seqlen_q, device=device).view(1, 1, -1, 1)
    col = torch.arange(seqlen_k, device=device).view(1, 1, 1, -1)
    before_leftpad = None
    valid_k = None if key_padding_mask is None else key_padding_mask.to(device).bool()
    if key_leftpad is not None:
        leftpad = _batch_view(key_leftpad.to(device=device, dtype=torch.long))
        before_leftpad = col < leftpad
        col = col - leftpad
        if valid_k is not None:
            valid_k = valid_k & ~before_leftpad.view(-1, seqlen_k)
    if valid_k is not None:
        sk = _batch_view(valid_k.sum(-1))
    elif key_leftpad is not None:
        sk = seqlen_k - leftpad
    else:
        sk = seqlen_k
    if query_padding_mask is not None:
        sq = _batch_view(query_padding_mask.to(device).bool().sum(-1))
    else:
        sq = seqlen_q
    return row, col, sq, sk, before_leftpad


def construct_local_mask(seqlen_q, seqlen_k, window_size=(-1, -1), query_padding_mask=None,
                         key_padding_mask=None, device=None, key_leftpad=None):
    """Bool (b or 1, 1, s_q, s_k), True = masked out: keys outside query i's window
    [i + sk - sq - left, i + sk - sq + right] (-1 = unbounded side) and keys before key_leftpad.
    Padded keys themselves are not marked here (attention_ref masks them with key_padding_mask);
    the padding masks only set the per-batch sq and sk."""
    row, col, sq, sk, before_leftpad = _geometry(
        seqlen_q, seqlen_k, query_padding_mask, key_padding_mask, key_leftpad, device)
    diag = row + sk - sq  # the key position aligned with query i
    masked = torch.zeros_like(diag + col, dtype=torch.bool)
    left, right = window_size
    if left >= 0:
        masked |= col < diag - left
    if right >= 0:
        masked |= col > diag + right
    if before_leftpad is not None:
        masked |= before_leftpad
    return masked


def construct_chunk_mask(seqlen_q, seqlen_k, attention_chunk, query_padding_mask=None,
                         key_padding_mask=None, key_leftpad=None, device=None):
    """Bool (b or 1, 1, s_q, s_k), True = masked out, for chunked attention: the keys are cut into
    chunks of attention_chunk positions, [0, c), [c, 2c), ..., and query i sees only the chunk
    that holds its aligned key position i + sk - sq (bottom-right alignment, as in
    construct_local_mask; a query aligned before key 0 falls in a chunk of negative positions and
    sees nothing). Keys before key_leftpad are masked and positions count from key_leftpad;
    padded keys themselves are left to key_padding_mask, as in construct_local_mask."""
    if isinstance(attention_chunk, bool) or not hasattr(attention_chunk, "__index__") or (
            attention_chunk <= 0):
        raise ValueError(f"attention_chunk: expected a positive int, got {attention_chunk!r}")
    row, col, sq, sk, before_leftpad = _geometry(
        seqlen_q, seqlen_k, query_padding_mask, key_padding_mask, key_leftpad, device)
    diag = row + sk - sq
    # Floor division, so aligned positions below 0 land in chunk -1, -2, ... (no key there).
    chunk_start = torch.div(diag, attention_chunk, rounding_mode="floor") * attention_chunk
    masked = (col < chunk_start) | (col >= chunk_start + attention_chunk)
    if before_leftpad is not None:
        masked = masked | before_leftpad
    return masked


def attn_bias_from_alibi_slopes(slopes, seqlen_q, seqlen_k, query_padding_mask=None,
                                key_padding_mask=None, causal=False, key_leftpad=None):
    """float32 (b or 1, h, s_q, s_k) bias -slope * |i + sk - sq - j|.

    slopes: (h,) or (b, h). The same exact distance serves causal and non-causal attention (the
    causal mask removes the keys right of the diagonal afterwards), so `causal` does not change
    the values; it is accepted for flash-attn compatibility."""
    del causal
    row, col, sq, sk, _ = _geometry(seqlen_q, seqlen_k, query_padding_mask, key_padding_mask,
                                    key_leftpad, slopes.device)
    distance = (row + sk - sq - col).abs().to(torch.float32)
    slopes = slopes.to(torch.float32)
    slopes = slopes.view(1, -1, 1, 1) if slopes.dim() == 1 else slopes.view(*slopes.shape, 1, 1)
    return -slopes * distance


def attention_ref(q, k, v, query_padding_mask=None, key_padding_mask=None, attn_bias=None,
                  dropout_p=0.0, dropout_mask=None, causal=False, window_size=(-1, -1),
                  softcap=0.0, alibi_slopes=None, upcast=True, reorder_ops=False,
                  key_leftpad=None, softmax_scale=None, attention_chunk=0):
    """Reference attention. Returns (output (b, s_q, h, d), attention (b, h, s_q, s_k)), both in
    q's dtype; attention is the softmax after masking and before dropout.

    upcast=True computes in fp32; upcast=False keeps the input dtype for the matmuls and the
    softmax (the dtype-error baseline). Bias terms (alibi, attn_bias) are added in their own dtype,
    so fp32 biases promote the scores, as in flash-attn's reference. reorder_ops=True scales k
    instead of q, another op order with the same math. Masked-out keys get probability 0; a row
    with no valid key gets attention 0 and output 0 (no NaN, also in the gradients).
    dropout_mask: bool (b, h, s_q, s_k), True = kept; the kept probabilities are scaled by
    1 / (1 - dropout_p). attention_chunk > 0 also restricts each query to its chunk of keys
    (construct_chunk_mask)."""
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    if nheads % nheads_k != 0:
        raise ValueError(f"k: expected a number of heads dividing q's {nheads}, got {nheads_k}")
    if dropout_p > 0.0 and dropout_mask is None:
        raise ValueError("dropout_mask: expected the keep-mask (b, h, s_q, s_k) when dropout_p > 0")
    if causal:
        window_size = (window_size[0], 0)
    dtype_og = q.dtype
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
    if nheads_k != nheads:
        # Query head j reads kv head j // (h // h_k).
        k = k.repeat_interleave(nheads // nheads_k, dim=2)
        v = v.repeat_interleave(nheads // nheads_k, dim=2)
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
    if reorder_ops:
        scores = torch.einsum("bthd,bshd->bhts", q, k * scale)
    else:
        scores = torch.einsum("bthd,bshd->bhts", q * scale, k)
    if softcap > 0.0:
        scores = torch.tanh(scores / softcap) * softcap
    if alibi_slopes is not None:
        scores = scores + attn_bias_from_alibi_slopes(
            alibi_slopes, seqlen_q, seqlen_k, query_padding_mask, key_padding_mask,
            key_leftpad=key_leftpad)
    if attn_bias is not None:
        scores = scores + attn_bias

    masked = None
    if key_padding_mask is not None:
        masked = ~key_padding_mask.bool().view(batch, 1, 1, seqlen_k)
    if window_size[0] >= 0 or window_size[1] >= 0 or key_leftpad is not None:
        local = construct_local_mask(seqlen_q, seqlen_k, window_size, query_padding_mask,
                                     key_padding_mask, q.device, key_leftpad)
        masked = local if masked is None else masked | local
    if attention_chunk > 0:
        chunk = construct_chunk_mask(seqlen_q, seqlen_k, attention_chunk, query_padding_mask,
                                     key_padding_mask, key_leftpad, q.device)
        masked = chunk if masked is None else masked | chunk
    if masked is not None:
        scores = scores.masked_fill(masked, float("-inf"))
    # Rows with nothing to attend to: softmax would give NaN (and NaN gradients), so give them
    # finite scores and zero the probabilities afterwards.
    empty_rows = torch.isneginf(scores).all(dim=-1, keepdim=True)
    scores = scores.masked_fill(empty_rows, 0.0)
    attention = torch.softmax(scores, dim=-1).masked_fill(empty_rows, 0.0).to(v.dtype)
    if query_padding_mask is not None:
        attention = attention.masked_fill(
            ~query_padding_mask.bool().view(batch, 1, seqlen_q, 1), 0.0)

    attention_drop = attention
    if dropout_mask is not None:
        attention_drop = attention.masked_fill(~dropout_mask, 0.0) / (1.0 - dropout_p)
    output = torch.einsum("bhts,bshd->bthd", attention_drop, v)
    if query_padding_mask is not None:
        output = output.masked_fill(~query_padding_mask.bool().view(batch, seqlen_q, 1, 1), 0.0)
    return output.to(dtype_og), attention.to(dtype_og)


def generate_random_padding_mask(max_seqlen, batch_size, device, mode="random",
                                 zero_lengths=False):
    """Bool (batch_size, max_seqlen), True = valid; the valid tokens of each row are a prefix.

    mode "full": every token valid; "random": lengths in [max_seqlen - 20, max_seqlen] (from 1 when
    max_seqlen is small); "third": lengths in [max_seqlen // 3, max_seqlen]. zero_lengths=True
    also empties every fifth sequence (0, 5, ...) and the last one. Lengths are drawn on the CPU
    generator, so a seed gives the same masks on every device."""
    if mode == "full":
        lengths = torch.full((batch_size,), max_seqlen, dtype=torch.long)
    elif mode == "random":
        lengths = torch.randint(max(1, max_seqlen - 20), max_seqlen + 1, (batch_size,))
    elif mode == "third":
        lengths = torch.randint(max_seqlen // 3, max_seqlen + 1, (batch_size,))
    else:
        raise ValueError(f"mode: expected 'full', 'random' or 'third', got {mode!r}")
    if zero_lengths and batch_size > 0:
        lengths[::5] = 0
        lengths[-1] = 0
    mask = torch.arange(max_seqlen).unsqueeze(0) < lengths.unsqueeze(1)
    return mask.to(device)


def _unpad(x, padding_mask):
    """(b, s, ...) -> (x_unpad, cu_seqlens, max_seqlen, pad_fn mapping (total, ...) -> (b, s, ...))."""
    batch, seqlen = x.shape[:2]
    if padding_mask is None:
        cu_seqlens = torch.arange(0, (batch + 1) * seqlen, seqlen, dtype=torch.int32,
                                  device=x.device)
        return (x.reshape(batch * seqlen, *x.shape[2:]), cu_seqlens, seqlen,
                lambda t: t.reshape(batch, seqlen, *t.shape[1:]))
    x_unpad, indices, cu_seqlens, max_seqlen, _ = unpad_input(x, padding_mask)
    return x_unpad, cu_seqlens, max_seqlen, lambda t: pad_input(t, indices, batch, seqlen)


def _leaf(t):
    return t.detach().requires_grad_()


def generate_qkv(q, k, v, query_padding_mask=None, key_padding_mask=None, kvpacked=False,
                 qkvpacked=False):
    """Varlen inputs and padded twins for one batch. q (b, s_q, h, d), k/v (b, s_k, h_k, d).

    neither: (q_unpad, k_unpad, v_unpad, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
              q, k, v, output_pad_fn, dq_pad_fn, dk_pad_fn)
    kvpacked: (q_unpad, kv_unpad, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q, kv,
               output_pad_fn, dq_pad_fn, dkv_pad_fn)
    qkvpacked: (qkv_unpad, cu_seqlens_q, max_seqlen_q, qkv, output_pad_fn, dqkv_pad_fn)
    Tensors come back as fresh leaves that require grad; the pad functions map unpadded (total, ...)
    tensors to padded (b, s, ...) ones with zeros in the padding."""
    q_unpad, cu_seqlens_q, max_seqlen_q, output_pad_fn = _unpad(q, query_padding_mask)
    k_unpad, cu_seqlens_k, max_seqlen_k, dk_pad_fn = _unpad(k, key_padding_mask)
    v_unpad = _unpad(v, key_padding_mask)[0]
    if qkvpacked:
        if q.shape[1] != k.shape[1] or q.shape[2] != k.shape[2]:
            raise ValueError("qkvpacked: expected q and k with the same sequence length and heads")
        same_masks = (query_padding_mask is None and key_padding_mask is None) or (
            query_padding_mask is not None and key_padding_mask is not None
            and torch.equal(query_padding_mask, key_padding_mask))
        if not same_masks:
            raise ValueError("qkvpacked: expected query_padding_mask equal to key_padding_mask")
        qkv_unpad = torch.stack([q_unpad, k_unpad, v_unpad], dim=1)
        qkv = torch.stack([q, k, v], dim=2)
        return (_leaf(qkv_unpad), cu_seqlens_q, max_seqlen_q, _leaf(qkv), output_pad_fn,
                output_pad_fn)
    if kvpacked:
        kv_unpad = torch.stack([k_unpad, v_unpad], dim=1)
        kv = torch.stack([k, v], dim=2)
        return (_leaf(q_unpad), _leaf(kv_unpad), cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                max_seqlen_k, _leaf(q), _leaf(kv), output_pad_fn, output_pad_fn, dk_pad_fn)
    return (_leaf(q_unpad), _leaf(k_unpad), _leaf(v_unpad), cu_seqlens_q, cu_seqlens_k,
            max_seqlen_q, max_seqlen_k, _leaf(q), _leaf(k), _leaf(v), output_pad_fn,
            output_pad_fn, dk_pad_fn)


def dropout_mask_from_S_dmask(S_dmask, seqlen_q, seqlen_k):
    """Keep-mask (b, h, s_q, s_k), True = kept, from the kernels' S_dmask
    (b, h, round128(s_q), round128(s_k)), whose negative entries mark dropped positions."""
    return S_dmask[:, :, :seqlen_q, :seqlen_k] >= 0


def check_error_rule(name, ours, ref, ref_lowp, slack=1e-5):
    """flash-attn's accuracy rule for a kernel output or gradient: its max-abs distance from the
    fp32 reference is at most twice that of the same reference computed in the input dtype
    (`ref_lowp`, e.g. attention_ref(..., upcast=False, reorder_ops=True)), plus a small absolute
    slack. NaN never passes."""
    assert not ours.isnan().any(), f"{name} has NaN"
    err = (ours.float() - ref.float()).abs().max().item()
    err_lowp = (ref_lowp.float() - ref.float()).abs().max().item()
    assert err <= 2 * err_lowp + slack, (
        f"{name}: max error {err} vs reference-in-dtype error {err_lowp}")


def random_window(causal, local, seqlen_k):
    """window_size of a test case: (-1, -1) unless local, else random sides below seqlen_k (the
    right side 0 when causal)."""
    if not local:
        return (-1, -1)
    left, right = torch.randint(0, max(seqlen_k, 1), (2,)).tolist()
    return (left, 0 if causal else right)


def heads_for(mha_type, nheads=6):
    """(query heads, key/value heads) of a test case: "mha", "gqa" (2 kv heads) or "mqa"."""
    return nheads, {"mha": nheads, "gqa": 2, "mqa": 1}[mha_type]


def triton_interpreter_slack(dtype, ref):
    """Extra absolute error allowed to a Triton kernel run on CPU tensors: the interpreter rounds
    float32 -> bfloat16 toward zero where the GPU rounds to nearest, which can cost one more
    bfloat16 ulp (<= |value| * 2^-7). GPU runs get no such slack."""
    if ref.device.type == "cpu" and dtype == torch.bfloat16:
        return ref.abs().max().item() * 2.0**-7
    return 0.0


def rotary_tables(seqlen_ro, rotary_dim, device, dtype=torch.float32):
    """Rotary cos, sin (seqlen_ro, rotary_dim / 2) of random angles in [0, 2 pi)."""
    angle = torch.rand(seqlen_ro, rotary_dim // 2, device=device) * 2 * math.pi
    return angle.cos().to(dtype), angle.sin().to(dtype)


# ----------------------------------------------------------------------------------------------
# Multi-process tests: one launcher for every test that needs several torch.distributed ranks.
# ----------------------------------------------------------------------------------------------


def run_child_with_flag(code, args, flag_name, flag_value, timeout):
    """Runs `python -c code *args` with the environment variable flag_name set to flag_value (or
    unset, for None): for flags the extension reads once per process. Fails the test with the
    child's output unless it exits 0; returns its stdout."""
    import subprocess
    import sys

    env = dict(os.environ)
    env.pop(flag_name, None)
    if flag_value is not None:
        env[flag_name] = str(flag_value)
    run = subprocess.run([sys.executable, "-c", code, *map(str, args)], env=env, capture_output=True, text=True,
                         timeout=timeout)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run.stdout


def cached_child_results(run):
    """get(flag, check): run(flag, check)'s result, each (flag, check) run once; a checked run's
    result (check=True: the child also ran its error-rule cases) serves an unchecked request too.
    For a module-scoped fixture, so that tests sharing a child process's results start it once."""
    cache = {}

    def get(flag, check):
        if (flag, True) in cache:
            return cache[flag, True]
        if (flag, check) not in cache:
            cache[flag, check] = run(flag, check)
        return cache[flag, check]
    return get


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_distributed(worker, world_size=2, backend="gloo", args=(), timeout=300, env=None):
    """Run worker(rank, world_size, *args) on world_size fresh processes that share a process
    group (backend over a free localhost port); return each rank's printed output (stdout and
    stderr), rank 0 first. A rank that raises, exits non-zero or outlives timeout (seconds) fails
    the calling test with every rank's output, the child's traceback included.

    worker must be a module-level function. Each child loads worker's file by its path (not
    pickled by module name as torch.multiprocessing.spawn would: under pytest's
    --import-mode=importlib a test module's name is importable only when pytest runs from the
    repository root), so `if __name__ == "__main__"` blocks there do not run. args are pickled.
    gloo ranks run on CPU, one thread each, with TRITON_INTERPRET=1 (Triton kernels on CPU tensors
    run only in the interpreter, also on GPU machines); nccl ranks use cuda:rank. env entries
    override the children's environment; None removes a variable."""
    import base64
    import inspect
    import pickle
    import subprocess
    import sys
    import tempfile
    import time

    import pytest

    import flash_attn

    if worker.__qualname__ != worker.__name__:
        raise ValueError(f"worker: expected a module-level function, got {worker.__qualname__}")
    path = inspect.getsourcefile(worker)
    payload = base64.b64encode(pickle.dumps(tuple(args))).decode()
    port = _free_port()
    # The children import the same flash_attn as this process, ahead of any installed copy.
    root = os.path.dirname(os.path.dirname(os.path.abspath(flash_attn.__file__)))
    child_env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [root, os.environ.get("PYTHONPATH")])))
    if backend == "gloo":
        child_env.update(TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    child_env["PYTHONUNBUFFERED"] = "1"  # a killed rank still leaves what it printed
    for key, value in (env or {}).items():
        if value is None:
            child_env.pop(key, None)
        else:
            child_env[key] = value
    boot = "from flash_attn.utils.testing import _distributed_rank; _distributed_rank()"
    logs, procs = [], []
    try:
        for rank in range(world_size):
            logs.append(tempfile.TemporaryFile(mode="w+"))
            procs.append(subprocess.Popen(
                [sys.executable, "-c", boot, path, worker.__name__, backend, str(rank),
                 str(world_size), str(port), payload],
                stdout=logs[-1], stderr=subprocess.STDOUT, env=child_env, text=True))
        deadline, stop_at = time.monotonic() + timeout, None
        # Poll rather than wait rank by rank: once one rank fails, the others may block in a
        # collective until gloo's own timeout (30 min). They get a few seconds to fail by
        # themselves (a closed connection, with their own traceback), then they are stopped.
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if stop_at is None and any(p.returncode not in (None, 0) for p in procs):
                stop_at = now + 5.0
            if now > deadline or (stop_at is not None and now > stop_at):
                break
            time.sleep(0.05)
        timed_out = stop_at is None and any(p.poll() is None for p in procs)
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        outputs = []
        for log in logs:
            log.seek(0)
            outputs.append(log.read())
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for log in logs:
            log.close()
    if timed_out or any(p.returncode != 0 for p in procs):
        what = f"did not finish within {timeout} s" if timed_out else "failed"
        report = "\n".join(f"---- rank {rank} (exit code {p.returncode}) ----\n{out}"
                           for rank, (p, out) in enumerate(zip(procs, outputs)))
        pytest.fail(f"{worker.__name__} on {world_size} {backend} ranks {what}:\n{report}",
                    pytrace=False)
    return outputs


def _distributed_rank():
    """Child side of run_distributed: argv = path, function name, backend, rank, world size,
    port, pickled args."""
    import base64
    import importlib.util
    import pickle
    import sys
    import traceback

    import torch.distributed as dist

    path, name, backend, rank, world_size, port, payload = sys.argv[1:]
    rank, world_size = int(rank), int(world_size)
    try:
        spec = importlib.util.spec_from_file_location(f"_distributed_worker_{rank}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        args = pickle.loads(base64.b64decode(payload))
        if backend == "nccl":
            torch.cuda.set_device(rank)
        else:
            torch.set_num_threads(1)  # several ranks share the CI machine's 2 cores
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size)
        try:
            getattr(module, name)(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        sys.exit(1)


def assert_causal_lm_matches_hf(hf_model, model, vocab_size, atol=1e-4, min_distinct_tokens=None):
    """Our GPTLMHeadModel against the transformers model it was loaded from: logits of a random
    batch within atol, and greedy generation token-identical. min_distinct_tokens: the greedy
    continuation must hold more distinct tokens than that (so the comparison means something)."""
    ids = torch.randint(2, vocab_size, (2, 20))
    with torch.no_grad():
        expected = hf_model(ids, attention_mask=torch.ones_like(ids)).logits
        logits = model(ids).logits
    assert (logits - expected).abs().max().item() <= atol
    prompt = ids[:, :5]
    with torch.no_grad():
        tokens = hf_model.generate(prompt, attention_mask=torch.ones_like(prompt), max_length=16,
                                   do_sample=False, eos_token_id=None, pad_token_id=1)
    if min_distinct_tokens is not None:
        assert len(tokens[0, 5:].unique()) > min_distinct_tokens
    assert torch.equal(model.generate(prompt, max_length=16), tokens)
