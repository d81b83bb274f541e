"""Tensor-parallel GPT on 2 gloo processes (CPU) against the single-process model: logits,
gradients (sharded the same way), and greedy generation.

The ranks are started by flash_attn.utils.testing.run_distributed.
"""

import pytest
import torch

from flash_attn.utils.testing import run_distributed

WORLD_SIZE = 2


def _missing_pieces():
    try:
        import flash_attn.ops.fused_dense  # noqa: F401  (ColumnParallelLinear, RowParallelLinear)
        import flash_attn.utils.distributed  # noqa: F401
    except Exception as error:  # not landed yet
        return f"tensor-parallel layers unavailable: {error}"
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        return "torch.distributed with gloo is unavailable"
    return None


def test_gpt_tensor_parallel_matches_single_process():
    reason = _missing_pieces()
    if reason:
        pytest.skip(reason)
    # What is checked here is the sharding; the Triton rotary kernel is covered by the
    # single-process tests, and in the interpreter it would take most of this test's time.
    outputs = run_distributed(run_rank, WORLD_SIZE, "gloo", env={"TRITON_INTERPRET": None})
    for out in outputs:
        assert "ALL CHECKS PASSED" in out, out[-4000:]


# ----------------------------------------------------------------------------------------------
# The worker (run as a script).
# ----------------------------------------------------------------------------------------------

VARIANTS = {
    "gpt2": dict(),
    "llama-like": dict(n_head_kv=2, rotary_emb_fraction=0.5, activation_function="swiglu",
                       rms_norm=True, n_positions=0, qkv_proj_bias=False, out_proj_bias=False,
                       mlp_fc1_bias=False, mlp_fc2_bias=False, mlp_multiple_of=16,
                       tie_word_embeddings=False),
}


class _GatherVocab(torch.autograd.Function):
    """All ranks' vocabulary slices side by side; every rank then computes the same loss, so the
    gradient of this rank's slice is just its part of the incoming gradient."""

    @staticmethod
    def forward(ctx, logits, group):
        import torch.distributed as dist

        ctx.rank, ctx.width = dist.get_rank(group), logits.shape[-1]
        parts = [torch.empty_like(logits) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, logits.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        return grad[..., ctx.rank * ctx.width: (ctx.rank + 1) * ctx.width], None


gather_vocab = _GatherVocab.apply


def run_rank(rank, world):
    import torch.distributed as dist
    import torch.nn.functional as F
    from transformers import GPT2Config

    from flash_attn.models.gpt import GPTLMHeadModel, shard_state_dict_tp
    from flash_attn.utils.distributed import allreduce_sequence_parallel_grad

    group = dist.group.WORLD
    for name, options in VARIANTS.items():
        for sequence_parallel in (True, False):
            config = GPT2Config(**dict(dict(
                n_layer=2, n_embd=64, n_head=4, vocab_size=100, n_positions=64, resid_pdrop=0.0,
                embd_pdrop=0.0, attn_pdrop=0.0, initializer_range=0.2, pad_vocab_size_multiple=8,
                sequence_parallel=sequence_parallel), **options))
            torch.manual_seed(0)  # same full model and inputs on every rank
            full = GPTLMHeadModel(config)
            ids = torch.randint(0, 100, (2, 12))
            tp = GPTLMHeadModel(config, process_group=group)
            tp.load_state_dict(shard_state_dict_tp(full.state_dict(), config, world, rank))

            logits_full = full(ids).logits
            logits_tp = gather_vocab(tp(ids).logits, group)  # training logits: vocab slices
            err = (logits_tp - logits_full).abs().max().item()
            assert err <= 1e-4, f"{name} sp={sequence_parallel}: logits differ by {err}"

            def loss_of(logits):
                return F.cross_entropy(logits[:, :-1, :100].flatten(0, 1), ids[:, 1:].flatten())

            loss_of(logits_full).backward()
            loss_of(logits_tp).backward()
            allreduce_sequence_parallel_grad(tp, group)
            grads_full = {k: p.grad for k, p in full.named_parameters()}
            grads_full = shard_state_dict_tp(grads_full, config, world, rank)
            for key, p in tp.named_parameters():
                err = (p.grad - grads_full[key]).abs().max().item()
                assert err <= 1e-4, f"{name} sp={sequence_parallel}: grad of {key} differs by {err}"

            if not sequence_parallel:  # generation runs without sequence parallelism
                full.eval(), tp.eval()
                prompt = ids[:, :4]
                assert torch.equal(tp.generate(prompt, max_length=12),
                                   full.generate(prompt, max_length=12)), f"{name}: generate"
            print(f"rank {rank}: {name} sequence_parallel={sequence_parallel} ok", flush=True)
    print("ALL CHECKS PASSED", flush=True)
