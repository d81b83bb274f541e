"""The warp-specialised sm90 forward (FLASH_ATTN_SM90_WS=1 its plain consumer loop, 2 the
overlapped ping-pong one, 3 that on the wide tile, unset the tile ws_forward_auto_mode picks; the binding reads the
flag once per process, so the cases run in child processes): flash-attn's error rule against the
fp32 reference for every score modifier and head layout it covers, padded and varlen
(test_flash_attn_interface's _run_and_check and test_varlen), batches with more work units than SMs
(the persistent CTAs walk several; masked ones pair blocks), plain and varlen calls bitwise equal
(test_packed_forms_match_plain), proof that the flag changes the kernel (its outputs differ from the
default kernel's in the last bits somewhere; bitwise equal everywhere would mean it never ran), and
the unset flag's dispatch.
"""

import textwrap
from pathlib import Path

import pytest
import torch

from flash_attn.utils.testing import cached_child_results, run_child_with_flag

TESTS = Path(__file__).resolve().parent

CHILD = textwrap.dedent("""
    import itertools, sys
    import torch
    sys.path.insert(0, sys.argv[1])
    from test_flash_attn_interface import (_run_and_check, test_packed_forms_match_plain,
                                           test_varlen)
    from flash_attn import flash_attn_func

    cases = 0
    for d, dtype, mha_type, (causal, local), (alibi, softcap), (sq, sk) in itertools.product(
            (64, 128), (torch.bfloat16, torch.float16), ("mha", "gqa"),
            ((False, False), (True, False), (False, True), (True, True)),
            ((False, 0.0), (True, 0.0), (False, 30.0)), ((113, 203), (1025, 1024), (1, 239))):
        if sys.argv[3] != "check":
            break
        torch.manual_seed(sq * 7 + sk + d)
        _run_and_check(2, sq, sk, d, dtype, mha_type, causal, local, alibi, softcap, 0.0)
        cases += 1
    # Head dims 192 and 256 (64-key blocks; 112 and 80 on the wide tile).
    wide = 0
    for d, mha_type, (causal, local), (alibi, softcap), (sq, sk) in itertools.product(
            (192, 256), ("mha", "gqa"), ((False, False), (True, False), (False, True), (True, True)),
            ((False, 0.0), (True, 0.0), (False, 30.0)), ((113, 203), (1025, 1024))):
        if sys.argv[3] != "check":
            break
        torch.manual_seed(sq * 7 + sk + d)
        _run_and_check(2, sq, sk, d, torch.bfloat16, mha_type, causal, local, alibi, softcap, 0.0)
        wide += 1
    varlen = 0
    for d, mha_type, (causal, local), (alibi, softcap), mode, (sq, sk) in itertools.product(
            (64, 128), ("mha", "gqa"), ((False, False), (True, False), (False, True)),
            ((False, 0.0), (True, 0.0), (False, 30.0)), ("random", "third", "zero_lengths"),
            ((97, 203), (1024, 1024))):
        if sys.argv[3] != "check":
            break
        test_varlen(sq, sk, d, torch.bfloat16, mha_type, causal, local, alibi, softcap, 0.0, mode)
        varlen += 1
    # A batch of 16: more work units than SMs, so CTAs walk several (and causal ones pair blocks).
    persistent = 0
    for d, (causal, local), (sq, sk) in itertools.product(
            (64, 128), ((False, False), (True, False), (True, True)), ((1025, 1024), (1000, 1300))):
        if sys.argv[3] != "check":
            break
        torch.manual_seed(sq + sk + d + causal)
        _run_and_check(16, sq, sk, d, torch.bfloat16, "mha", causal, local, False, 0.0, 0.0)
        persistent += 1
    packed = 0
    for dtype, causal in itertools.product((torch.bfloat16, torch.float16), (False, True)):
        if sys.argv[3] != "check":
            break
        test_packed_forms_match_plain(dtype, causal)  # plain and varlen: the same kernel, bitwise
        packed += 1
    outs = {}
    for d, causal, (sq, sk) in itertools.product(
            (64, 128, 192, 256), (False, True),
            ((1000, 1000), (1536, 1536), (2048, 2048), (8192, 8192), (1, 8192), (64, 8192))):
        torch.manual_seed(d)
        q = torch.randn(1, sq, 4, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(1, sk, 4, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        outs[d, causal, sq, sk] = flash_attn_func(q, k, v, causal=causal).cpu()
    torch.save(outs, sys.argv[2])
    print(f"{cases} padded, {wide} d192/d256, {varlen} varlen, {persistent} batch-16 and {packed} packed cases passed")
""")


def _child(tmp_path, ws, check=True):
    """ws: the FLASH_ATTN_SM90_WS value (0 the default kernel), or None to leave it unset; check:
    run the error-rule cases too (modes 1, 2 and 3)."""
    check = check and ws in (1, 2, 3)
    out_file = tmp_path / f"outs_{ws}.pt"
    # The default kernel's error rule is test_flash_attn_interface's: here only its outputs.
    stdout = run_child_with_flag(CHILD, (TESTS, out_file, "check" if check else "outputs"), "FLASH_ATTN_SM90_WS",
                                 ws, timeout=600)
    assert not check or "288 padded, 96 d192/d256, 216 varlen, 12 batch-16 and 4 packed cases passed" in stdout, (
        stdout[-3000:])
    return torch.load(out_file)


@pytest.fixture(scope="module")
def outs_by_mode(tmp_path_factory):
    """The children's fixed-input outputs by flag value, each child run once per module and worker
    (modes 1-3 with the error-rule cases unless check=False)."""
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the warp-specialised forward is sm90 only")
    get = cached_child_results(lambda ws, check: _child(tmp_path_factory.mktemp("ws_fwd"), ws, check))
    return lambda ws, check=True: get(ws, check)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [1, 2, 3])
def test_ws_forward_meets_the_error_rule_and_is_a_different_kernel(outs_by_mode, mode):
    ws, default = outs_by_mode(mode), outs_by_mode(0)
    assert ws.keys() == default.keys()
    for key in ws:
        torch.testing.assert_close(ws[key], default[key], atol=4e-3, rtol=0)
    assert any(not torch.equal(ws[key], default[key]) for key in ws), (
        f"FLASH_ATTN_SM90_WS={mode} gave bitwise the default kernel's outputs: the flag did nothing")


def _auto_mode(d, causal, sq, sk):
    """flash_fwd_launch.h's ws_forward_auto_mode, with the decode tile's exception."""
    if sq <= 64 and not causal:
        return 0
    if d <= 64:
        return 0 if sk < 2048 else 2 if causal and sk < 4096 else 3
    if d <= 128:
        return 2 if sk >= 1024 else 0
    return 0 if sk < 1024 else 2 if causal else 3


@pytest.mark.gpu
def test_unset_flag_takes_the_auto_mode(outs_by_mode):
    """FLASH_ATTN_SM90_WS unset: the default kernel below the lengths ws_forward_auto_mode names and
    where it takes the decode tile (<= 64 queries, no mask), mode 2 or 3 otherwise (bitwise each)."""
    auto = outs_by_mode(None)
    for d, causal, sq, sk in auto:
        expected = outs_by_mode(_auto_mode(d, causal, sq, sk), check=False)
        assert torch.equal(auto[d, causal, sq, sk], expected[d, causal, sq, sk]), (d, causal, sq, sk)
    # Where auto takes a warp-specialised mode the outputs tell the kernels apart. On the
    # decode-shaped calls they do not (on the H200 mode 2 and the decode tile agree bitwise there:
    # one query block, 128-key blocks both): there auto == default checks the result, not which
    # kernel ran.
    off = outs_by_mode(0)
    for mode in (2, 3):
        assert any(not torch.equal(auto[key], off[key]) for key in auto
                   if _auto_mode(*key) == mode and key[2] > 64), mode
