"""The warp-specialised sm90 backward (FLASH_ATTN_SM90_WS_BWD=1; the binding reads the flag once per
process, so the cases run in child processes): flash-attn's error rule on dq, dk, dv against the
fp32 reference (test_flash_attn_backward's _run_and_check and test_backward_varlen) for every
head layout and score modifier it covers (masks, ALiBi, softcap), padded and varlen, a batch with
more CTAs than SMs, dropout (the forward's mask redrawn on the transposed tile), the deterministic
mode bitwise repeatable. Which kernel ran is read from the profiler's kernel names: with the flag
set, the warp-specialised one for every call (head dims 64, 128 and 256); unset, where
flash_bwd_launch.h's kWsBwdMinKeys says (_ws_backward_by_default), with gradients bitwise those
of the kernel that ran (where they repeat from run to run).
"""

import textwrap
from pathlib import Path

import pytest
import torch

from flash_attn.utils.testing import cached_child_results, run_child_with_flag

TESTS = Path(__file__).resolve().parent

CHILD = textwrap.dedent("""
    import itertools, re, sys
    import torch
    sys.path.insert(0, sys.argv[1])
    from test_flash_attn_backward import (_run_and_check, test_backward_varlen,
                                          test_deterministic_backward_is_bitwise_reproducible)
    from torch.profiler import ProfilerActivity, profile
    from flash_attn import flash_attn_func

    check = sys.argv[3] == "check"
    cases = dropout = varlen = batch16 = deterministic = turns = 0
    for d, dtype, mha_type, (causal, local), (alibi, softcap), (sq, sk) in itertools.product(
            (64, 128, 256), (torch.bfloat16, torch.float16), ("mha", "gqa", "mqa"),
            ((False, False), (True, False), (False, True), (True, True)),
            ((False, 0.0), (True, 0.0), (False, 30.0)), ((113, 203), (1025, 1024), (1, 239))):
        if not check:
            break
        torch.manual_seed(sq + 7 * sk + d)
        _run_and_check(2, sq, sk, d, dtype, mha_type, causal, local, alibi, softcap, 0.0)
        cases += 1
    # Dropout: the kernel redraws the forward's mask on S^T (the reference takes it from S_dmask).
    for d, mha_type, (causal, local), (alibi, softcap), (sq, sk) in itertools.product(
            (64, 128, 256), ("mha", "gqa"), ((False, False), (True, False), (False, True)),
            ((False, 0.0), (True, 0.0), (False, 30.0)), ((113, 203), (1025, 1024))):
        if not check:
            break
        torch.manual_seed(sq + 3 * sk + d)
        _run_and_check(2, sq, sk, d, torch.bfloat16, mha_type, causal, local, alibi, softcap, 0.17)
        dropout += 1
    for d, mha_type, (causal, local), mode, (sq, sk) in itertools.product(
            (64, 128, 256), ("mha", "gqa"), ((False, False), (True, False), (False, True)),
            ("random", "zero_lengths"), ((97, 203), (1024, 1024))):
        if not check:
            break
        test_backward_varlen(sq, sk, d, torch.bfloat16, mha_type, causal, local, 0.0, mode)
        varlen += 1
    # More CTAs than SMs (batch 16 x 6 heads x 8 key blocks), causal ones of unequal work.
    for d, causal in itertools.product((64, 128, 256), (False, True)):
        if not check:
            break
        torch.manual_seed(d + causal)
        _run_and_check(16, 1025, 1024, d, torch.bfloat16, "mha", causal, False, False, 0.0, 0.0)
        batch16 += 1
    for mha_type, dropout_p, varlen_input in itertools.product(("mha", "gqa"), (0.0, 0.17), (False, True)):
        if not check:
            break
        test_deterministic_backward_is_bitwise_reproducible(mha_type, dropout_p, varlen_input)
        deterministic += 1
    # Which loop ran (the kernel's last template argument, Takes_turns): d64's consumers take turns
    # under a mask, and unmasked from 8K queries and keys (BackwardWs::unmasked_takes_turns); the long
    # unmasked cases meet the error rule with every score modifier.
    def turns_ran(*case):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            _run_and_check(*case)
        names = [e.name for e in prof.events() if "flash_bwd_ws_kernel" in e.name]
        flags = {re.search(r",\\s*(true|false)>\\s*\\(", n).group(1) for n in names}
        assert len(flags) == 1, names
        return flags.pop() == "true"
    for dtype, (mha_type, alibi, softcap, dropout_p), (sq, sk) in itertools.product(
            (torch.bfloat16, torch.float16),
            (("mha", False, 0.0, 0.0), ("gqa", True, 0.0, 0.0), ("mqa", False, 30.0, 0.0), ("gqa", False, 0.0, 0.17)),
            ((8192, 8192), (8201, 8319))):
        if not check:
            break
        torch.manual_seed(sq + sk)
        assert turns_ran(1, sq, sk, 64, dtype, mha_type, False, False, alibi, softcap, dropout_p), (sq, sk)
        turns += 1
    for d, causal, local, (sq, sk), expected in (
            (64, False, False, (2048, 2048), False), (64, False, False, (8192, 2048), False),
            (64, False, False, (2048, 8192), False), (64, True, False, (1025, 1024), True),
            (64, False, True, (2048, 2048), True), (128, False, False, (8192, 8192), False),
            (128, True, False, (1025, 1024), False)):
        if not check:
            break
        torch.manual_seed(sq + d)
        assert turns_ran(1, sq, sk, d, torch.bfloat16, "mha", causal, local, False, 0.0, 0.0) == expected, (
            d, causal, local, sq, sk)
        turns += 1

    # Gradients of fixed inputs, for the comparison across processes, and whether the
    # warp-specialised kernel computed them.
    grads, ws_ran = {}, {}
    for d, causal, (sq, sk), extra in itertools.product(
            (64, 128, 256), (False, True), ((113, 203), (1024, 1024), (2048, 2048), (4096, 4096)),
            ("plain", "softcap", "dropout", "deterministic")):
        torch.manual_seed(d + sq)
        q, k, v = (torch.randn(2, n, 4, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for n in (sq, sk, sk))
        kwargs = dict(causal=causal, softcap=30.0 if extra == "softcap" else 0.0,
                      deterministic=extra == "deterministic")
        out = flash_attn_func(q, k, v, 0.1 if extra == "dropout" else 0.0, **kwargs)
        g = torch.randn_like(out)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            grads[d, causal, sq, sk, extra] = [t.cpu() for t in torch.autograd.grad(out, (q, k, v), g)]
        kernels = {e.name for e in prof.events() if "flash_bwd" in e.name}
        assert any("flash_bwd_kernel" in n or "flash_bwd_ws_kernel" in n for n in kernels), kernels
        ws_ran[d, causal, sq, sk, extra] = any("flash_bwd_ws_kernel" in n for n in kernels)
    torch.save((grads, ws_ran), sys.argv[2])
    print(f"{cases} padded, {dropout} dropout, {varlen} varlen, {batch16} batch-16, {deterministic} "
          f"deterministic and {turns} turns cases passed")
""")


def _child(tmp_path, flag, check):
    """flag: the FLASH_ATTN_SM90_WS_BWD value, or None to leave it unset; check: run the error-rule
    cases too. Returns the child's fixed-input gradients and which of them the warp-specialised
    kernel computed, by case."""
    out_file = tmp_path / f"grads_{flag}.pt"
    stdout = run_child_with_flag(CHILD, (TESTS, out_file, "check" if check else "grads"), "FLASH_ATTN_SM90_WS_BWD",
                                 flag, timeout=900)
    assert not check or "648 padded, 108 dropout, 72 varlen, 6 batch-16, 8 deterministic and 23 turns cases passed" in stdout, (
        stdout[-3000:])
    return torch.load(out_file)


def _bitwise_stable(key, name):
    """Whether a gradient repeats bitwise from run to run: dk and dv (each key block's CTA owns
    them), and dq only in the deterministic mode (else the key blocks' dQ tiles are added in
    whatever order they finish)."""
    return name != "dq" or key[4] == "deterministic"


@pytest.fixture(scope="module")
def grads_by_flag(tmp_path_factory):
    """The children's fixed-input gradients by flag value, each child run once per module and worker
    (the one with the flag set also runs the error-rule cases, unless check=False)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the warp-specialised backward is sm90 only")
    get = cached_child_results(lambda flag, check: _child(tmp_path_factory.mktemp("ws_bwd"), flag, check))
    return lambda flag, check=None: get(flag, flag == "1" if check is None else check)


@pytest.mark.gpu
def test_ws_backward_meets_the_error_rule_and_runs_where_it_covers(grads_by_flag):
    (ws, ws_ran), (default, default_ran) = grads_by_flag("1"), grads_by_flag("0")
    assert ws.keys() == default.keys()
    for key in ws:
        assert ws_ran[key], (key, "FLASH_ATTN_SM90_WS_BWD=1: the kernel that ran")
        assert not default_ran[key], (key, "FLASH_ATTN_SM90_WS_BWD=0 ran the warp-specialised kernel")
        for name, ours, theirs in zip(("dq", "dk", "dv"), ws[key], default[key]):
            # both meet the error rule (above and in test_flash_attn_backward): they agree closely
            scale = theirs.abs().max().item()
            assert (ours.float() - theirs.float()).abs().max().item() <= 2e-2 * scale + 1e-3, (key, name)


def _ws_backward_by_default(d, causal, sk):
    """flash_bwd_launch.h's kWsBwdMinKeys: from 1K keys, every covered head dim, masked or not."""
    return sk >= 1024


@pytest.mark.gpu
def test_unset_flag_takes_the_ws_backward_where_the_rule_says(grads_by_flag):
    """FLASH_ATTN_SM90_WS_BWD unset: the warp-specialised kernel where _ws_backward_by_default says,
    the key-block kernel everywhere else (bitwise each)."""
    (auto, auto_ran), (ws, _), (off, _) = grads_by_flag(None), grads_by_flag("1", check=False), grads_by_flag("0")
    chosen = {key: _ws_backward_by_default(key[0], key[1], key[3]) for key in auto}
    assert any(chosen.values()) and not all(chosen.values())
    for key in auto:
        assert auto_ran[key] == chosen[key], (key, "flag unset: the kernel that ran")
        expected = ws if chosen[key] else off
        for name, ours, theirs in zip(("dq", "dk", "dv"), auto[key], expected[key]):
            assert not _bitwise_stable(key, name) or torch.equal(ours, theirs), (key, name)
