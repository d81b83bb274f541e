"""FLASH_ATTN_CHECK_INPUTS=1: varlen offsets validated on the host before any kernel runs.

Without the variable the checks stay off (no device sync): the same inputs then reach the next
check, the device check, which on this CPU machine is the error that proves nothing else fired.
"""

import pytest
import torch

from flash_attn import flash_attn_varlen_func


def _cu(offsets):
    return torch.tensor(offsets, dtype=torch.int32)


def _qkv(total_q, total_k):
    return (torch.randn(total_q, 2, 16).half(), torch.randn(total_k, 2, 16).half(),
            torch.randn(total_k, 2, 16).half())


def _paged(num_blocks=3, page_block_size=256):
    k = torch.randn(num_blocks, page_block_size, 2, 16).half()
    return k, torch.randn_like(k)


# (arguments of flash_attn_varlen_func, the error FLASH_ATTN_CHECK_INPUTS=1 must raise)
INCONSISTENT = [
    ((*_qkv(10, 10), _cu([0, 6, 12]), _cu([0, 5, 10]), 6, 5), "cu_seqlens_q must be offsets within the 10"),
    ((*_qkv(10, 10), _cu([0, 4, 10]), _cu([0, 5, 11]), 6, 6), "cu_seqlens_k must be offsets within the 10"),
    ((*_qkv(10, 10), _cu([0, 3, 10]), _cu([0, 5, 10]), 5, 5), "max_seqlen_q must be at least the longest"),
    ((*_qkv(10, 10), _cu([0, 5, 10]), _cu([0, 2, 10]), 5, 7), "max_seqlen_k must be at least the longest"),
    ((*_qkv(10, 10), _cu([1, 5, 10]), _cu([0, 5, 10]), 5, 5), "cu_seqlens_q must be offsets starting at 0"),
    ((*_qkv(10, 10), _cu([0, 6, 4]), _cu([0, 5, 10]), 6, 5), "cu_seqlens_q must be non-decreasing"),
]
PAGED_INCONSISTENT = [
    # 600 keys need 3 blocks of 256; the table has 2 per sequence.
    (dict(cu_seqlens_k=_cu([0, 600]), max_seqlen_k=600, block_table=_cu([[0, 1]])),
     "cu_seqlens_k must be sequences of at most 512 keys"),
    (dict(cu_seqlens_k=_cu([0, 300]), max_seqlen_k=300, block_table=_cu([[0, 3]])),
     r"block_table must be block indices in \[0, 3\)"),
]


def _paged_call(cu_seqlens_k, max_seqlen_k, block_table):
    q = torch.randn(4, 2, 16).half()
    return flash_attn_varlen_func(q, *_paged(), _cu([0, 4]), cu_seqlens_k, 4, max_seqlen_k,
                                  block_table=block_table)


@pytest.mark.parametrize("args,match", INCONSISTENT)
def test_inconsistent_offsets_are_named_with_checks_on(args, match, monkeypatch):
    monkeypatch.setenv("FLASH_ATTN_CHECK_INPUTS", "1")
    with pytest.raises(ValueError, match=match):
        flash_attn_varlen_func(*args)


@pytest.mark.parametrize("kwargs,match", PAGED_INCONSISTENT)
def test_inconsistent_paged_tables_are_named_with_checks_on(kwargs, match, monkeypatch):
    monkeypatch.setenv("FLASH_ATTN_CHECK_INPUTS", "1")
    with pytest.raises(ValueError, match=match):
        _paged_call(**kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU device error is the witness here")
@pytest.mark.parametrize("args,match", INCONSISTENT)
def test_checks_are_off_by_default(args, match, monkeypatch):
    monkeypatch.delenv("FLASH_ATTN_CHECK_INPUTS", raising=False)
    with pytest.raises(ValueError, match="q must be on a CUDA device"):
        flash_attn_varlen_func(*args)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU device error is the witness here")
def test_consistent_offsets_pass_the_checks(monkeypatch):
    monkeypatch.setenv("FLASH_ATTN_CHECK_INPUTS", "1")
    with pytest.raises(ValueError, match="q must be on a CUDA device"):
        flash_attn_varlen_func(*_qkv(10, 12), _cu([0, 4, 10]), _cu([0, 5, 12]), 6, 7)
    with pytest.raises(ValueError, match="q must be on a CUDA device"):
        _paged_call(_cu([0, 300]), 300, _cu([[2, 0]]))


@pytest.mark.gpu
def test_checks_on_gpu_tensors(monkeypatch):
    """The host checks read device offsets correctly, and valid inputs still run."""
    monkeypatch.setenv("FLASH_ATTN_CHECK_INPUTS", "1")
    q, k, v = (t.cuda() for t in _qkv(10, 10))
    with pytest.raises(ValueError, match="cu_seqlens_k must be offsets within the 10"):
        flash_attn_varlen_func(q, k, v, _cu([0, 4, 10]).cuda(), _cu([0, 5, 11]).cuda(), 6, 6)
    out = flash_attn_varlen_func(q, k, v, _cu([0, 4, 10]).cuda(), _cu([0, 5, 10]).cuda(), 6, 5)
    assert out.shape == q.shape and torch.isfinite(out).all()
