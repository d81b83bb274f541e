"""AttentionOptions and the path it travels: public function -> autograd Function -> op -> kernel.

The kernel is CUDA-only, so the plumbing tests register a CPU stand-in for the two ops of the
autograd Functions (the fp32 reference of flash_attn.utils.testing, its gradients by autograd)
and let CPU tensors past the device check. They show that every option reaches the kernel as the
caller gave it (softmax_scale resolved for the unpadded head dim), that each Function returns one
gradient per input, and that torch.compile traces the path without a graph break.
"""

import dataclasses

import pytest
import torch

import flash_attn.attention_checks as attention_checks
from flash_attn import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)
from flash_attn.attention_options import OP_SCHEMA, AttentionOptions
from flash_attn.utils.testing import attention_ref


def test_op_args_round_trip_and_resolve_the_default_scale():
    options = AttentionOptions.create(dropout_p=0.1, causal=True, window_size=[4.0, 2],
                                      softcap=3.0, deterministic=1, return_attn_probs=True)
    assert (options.window_size_left, options.window_size_right) == (4, 2)
    assert isinstance(options.window_size_left, int) and options.deterministic is True
    rebuilt = AttentionOptions.from_op_args(options.op_args(head_dim=16))
    assert rebuilt == dataclasses.replace(options, softmax_scale=0.25)
    assert AttentionOptions(softmax_scale=0.5).op_args(head_dim=16)[1] == 0.5


def test_return_softmax_needs_dropout():
    assert not AttentionOptions(return_attn_probs=True).return_softmax
    assert AttentionOptions(dropout_p=0.1, return_attn_probs=True).return_softmax
    assert not AttentionOptions(dropout_p=0.1).return_softmax


@pytest.mark.parametrize("op", ["_attention_forward", "_attention_backward",
                                "_flash_attn_kvcache_forward"])
def test_op_schemas_end_in_the_option_fields(op):
    import flash_attn.attention_ops  # noqa: F401  (defines the ops)

    schema = getattr(torch.ops.flash_attn, op).default._schema
    fields = dataclasses.fields(AttentionOptions)
    tail = schema.arguments[-len(fields):]
    assert [a.name for a in tail] == [f.name for f in fields]
    assert OP_SCHEMA.endswith("bool return_attn_probs")


@pytest.mark.parametrize("kwargs,match", [
    (dict(dropout_p=-0.1), "dropout_p must be in"),
    (dict(softcap=float("nan")), "softcap must be >= 0"),
    (dict(window_size=(True, 0)), "window_size must be a pair"),
    (dict(window_size=(0, -2)), "window_size must be a pair"),
])
def test_create_names_the_bad_option(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AttentionOptions.create(**kwargs)


# --- the plumbing, with a CPU stand-in for the kernel ------------------------------------------

def _reference(q, k, v, alibi_slopes, options):
    """attention_ref on one padded batch; the stand-in for what the kernel computes."""
    out, _ = attention_ref(q, k, v, causal=options.causal,
                           window_size=(options.window_size_left, options.window_size_right),
                           softcap=options.softcap, alibi_slopes=alibi_slopes,
                           softmax_scale=options.softmax_scale)
    return out


def _per_sequence(fn, q, k, v, cu_seqlens_q, cu_seqlens_k):
    """fn(q, k, v) of each varlen sequence (batch 1), concatenated."""
    if cu_seqlens_q is None:
        return fn(q, k, v)
    outs = []
    for b in range(cu_seqlens_q.numel() - 1):
        sq = slice(int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]))
        sk = slice(int(cu_seqlens_k[b]), int(cu_seqlens_k[b + 1]))
        outs.append(fn(q[None, sq], k[None, sk], v[None, sk])[0])
    return torch.cat(outs)


@pytest.fixture
def cpu_kernel(monkeypatch):
    """The ops run the stand-in on CPU tensors, and the public functions accept CPU tensors."""
    monkeypatch.setattr(attention_checks, "_check_devices", lambda *args, **kwargs: None)
    seen = []
    lib = torch.library.Library("flash_attn", "IMPL")

    def forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table,
                alibi_slopes, *option_args):
        options = AttentionOptions.from_op_args(option_args)
        seen.append(options)
        out = _per_sequence(lambda q, k, v: _reference(q, k, v, alibi_slopes, options),
                            q, k, v, cu_seqlens_q, cu_seqlens_k)
        # (the stand-in leaves softmax_lse zero: its backward recomputes from q, k, v)
        lse_shape = ((q.shape[0], q.shape[2], q.shape[1]) if cu_seqlens_q is None
                     else (q.shape[1], q.shape[0]))
        return (out.contiguous(), q.new_zeros(lse_shape, dtype=torch.float32), q.new_empty(0),
                q.new_zeros(2, dtype=torch.int64))

    def backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                 max_seqlen_q, max_seqlen_k, alibi_slopes, rng_state, *option_args):
        options = AttentionOptions.from_op_args(option_args)
        seen.append(options)
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            again = _per_sequence(lambda q, k, v: _reference(q, k, v, alibi_slopes, options),
                                  *leaves, cu_seqlens_q, cu_seqlens_k)
            grads = torch.autograd.grad(again, leaves, dout)
        for target, grad in zip((dq, dk, dv), grads):
            target.copy_(grad)
        return softmax_lse.clone()

    lib.impl("_attention_forward", forward, "CPU")
    lib.impl("_attention_backward", backward, "CPU")
    yield seen
    lib._destroy()


def _leaves(*shapes):
    return [torch.randn(shape, dtype=torch.float16).requires_grad_() for shape in shapes]


OPTIONS = dict(causal=True, window_size=(5, -1), softcap=2.0, deterministic=True)


def test_every_option_reaches_the_kernel_and_gradients_line_up(cpu_kernel):
    torch.manual_seed(0)
    q, k, v = _leaves((2, 9, 4, 12), (2, 11, 2, 12), (2, 11, 2, 12))  # head dim 12: padded to 16
    slopes = torch.rand(4) * 0.3
    out, lse, S_dmask = flash_attn_func(q, k, v, alibi_slopes=slopes, return_attn_probs=True,
                                        **OPTIONS)
    expected = AttentionOptions(softmax_scale=12 ** -0.5, causal=True, window_size_left=5,
                                softcap=2.0, deterministic=True, return_attn_probs=True)
    assert cpu_kernel == [expected]
    assert lse.shape == (2, 4, 9) and S_dmask.numel() == 0
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert cpu_kernel == [expected, expected]
    ref = _reference(q, k, v, slopes, expected)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3)
    for ours, theirs in zip(grads, ref_grads):
        torch.testing.assert_close(ours, theirs, atol=2e-3, rtol=2e-3)


def test_packed_and_varlen_functions(cpu_kernel):
    torch.manual_seed(0)
    (qkv,) = _leaves((2, 8, 3, 2, 16))
    q, k, v = qkv.unbind(2)
    ref = _reference(q, k, v, None, AttentionOptions(softmax_scale=0.25, causal=True))
    torch.testing.assert_close(flash_attn_qkvpacked_func(qkv, causal=True), ref)
    (dqkv,) = torch.autograd.grad(flash_attn_qkvpacked_func(qkv, causal=True).sum(), (qkv,))
    torch.testing.assert_close(dqkv, torch.stack(torch.autograd.grad(ref.sum(), (q, k, v)), 2))
    kv = qkv[:, :, 1:].detach().requires_grad_()
    torch.autograd.grad(flash_attn_kvpacked_func(q, kv, causal=True).sum(), (qkv, kv))

    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    flat = qkv.detach()[0].requires_grad_()  # (8, 3, h, d): two sequences of 3 and 5 tokens
    fq, fk, fv = flat.unbind(1)
    options = AttentionOptions(softmax_scale=0.5, causal=True)
    expected = torch.cat([_reference(fq[None, s], fk[None, s], fv[None, s], None, options)[0]
                          for s in (slice(0, 3), slice(3, 8))])
    del cpu_kernel[:]
    torch.testing.assert_close(
        flash_attn_varlen_func(fq, fk, fv, cu, cu, 5, 5, softmax_scale=0.5, causal=True), expected)
    torch.testing.assert_close(
        flash_attn_varlen_qkvpacked_func(flat, cu, 5, softmax_scale=0.5, causal=True), expected)
    assert cpu_kernel == [options, options]
    fkv = flat[:, 1:].detach().requires_grad_()
    torch.autograd.grad(flash_attn_varlen_kvpacked_func(fq, fkv, cu, cu, 5, 5).sum(), (flat, fkv))


def test_training_step_compiles_without_graph_breaks(cpu_kernel):
    torch.manual_seed(0)
    q, k, v = _leaves((1, 16, 2, 16), (1, 16, 2, 16), (1, 16, 2, 16))

    def step(q, k, v):
        return flash_attn_func(q, k, v, **OPTIONS).float().square().sum()

    torch._dynamo.reset()
    grads = torch.autograd.grad(torch.compile(step, fullgraph=True)(q, k, v), (q, k, v))
    expected = torch.autograd.grad(step(q, k, v), (q, k, v))
    for ours, theirs in zip(grads, expected):
        torch.testing.assert_close(ours, theirs, atol=0, rtol=0)
