"""flash_attn.models.presets: the GPT-2 sizes match HF's GPT-2, the Llama-style preset builds
Llama's blocks, fused=True turns on the fused paths, bad shapes are refused, and the FLOP count.
(Here, beside the trainer that uses them, as the task placed them.)"""

import pytest
import torch
import torch.nn as nn
from transformers import GPT2LMHeadModel

from flash_attn.models.gpt import GPTLMHeadModel
from flash_attn.models.presets import PRESETS, gpt_config, training_flops_per_token

GPT2_VOCAB = 50257


def _numel(model):
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("preset", ["gpt2-small", "gpt2-medium", "gpt2-large", "gpt2-xl"])
def test_gpt2_presets_have_gpt2s_parameters(preset):
    config = gpt_config(preset, GPT2_VOCAB, 1024)
    with torch.device("meta"):
        ours, hf = GPTLMHeadModel(config, device="meta"), GPT2LMHeadModel(config)
    padding = (config.vocab_size + 7) // 8 * 8 - config.vocab_size  # vocabulary rows padded to 8
    assert _numel(ours) == _numel(hf) + padding * config.n_embd
    if preset == "gpt2-small":
        assert _numel(hf) == 124_439_808  # GPT-2 small as published


def test_llama_style_preset_builds_llama_blocks():
    config = gpt_config("llama-small", 256, 64, n_layer=2, n_embd=64, n_head=4, n_head_kv=2)
    model = GPTLMHeadModel(config)
    block = model.transformer.layers[0]
    assert isinstance(block.norm1, nn.RMSNorm) and isinstance(model.transformer.ln_f, nn.RMSNorm)
    assert type(block.mlp).__name__ == "GatedMlp"
    assert block.mlp.activation is torch.nn.functional.silu  # SwiGLU
    assert block.mixer.rotary_emb_dim == 16 and block.mixer.num_heads_kv == 2
    assert not hasattr(model.transformer.embeddings, "position_embeddings")
    assert model.lm_head.weight is not model.transformer.embeddings.word_embeddings.weight
    assert all(not name.endswith(".bias") for name, _ in model.named_parameters())
    # Rotary: no fixed length; 100 > the 64 it was configured with.
    assert model(torch.randint(0, 256, (1, 100))).logits.shape == (1, 100, 256)


def test_fused_turns_on_every_fused_path_the_shape_has():
    plain = gpt_config("gpt2-small", 256, 128)
    assert not any(getattr(plain, flag, False) for flag in (
        "use_flash_attn", "fused_bias_fc", "fused_mlp", "fused_dropout_add_ln"))
    fused = gpt_config("gpt2-small", 256, 128, fused=True)
    assert fused.use_flash_attn and fused.fused_bias_fc and fused.fused_mlp
    assert fused.fused_dropout_add_ln and fused.residual_in_fp32
    llama = gpt_config("llama-small", 256, 128, fused=True)
    assert llama.use_flash_attn and llama.fused_bias_fc
    assert not llama.fused_mlp  # gated MLPs have no FusedMLP


def test_overrides_and_dropout():
    config = gpt_config("gpt2-medium", 256, 64, n_layer=3, dropout=0.2, n_head_kv=None)
    assert (config.n_layer, config.n_embd, config.n_head) == (3, 1024, 16)
    assert config.resid_pdrop == config.embd_pdrop == config.attn_pdrop == 0.2
    assert gpt_config("gpt-mini", 256, 64).resid_pdrop == 0.0


@pytest.mark.parametrize("kwargs, message", [
    (dict(preset="gpt3"), "unknown preset 'gpt3'; expected one of gpt-mini"),
    (dict(n_embd=100, n_head=3), "n_embd 100 is not divisible by n_head 3"),
    (dict(n_head=12, n_head_kv=5), "n_head 12 is not divisible by n_head_kv 5"),
    (dict(n_layer=0), "n_layer must be a positive integer"),
    (dict(seqlen=0), "seqlen must be a positive integer"),
    (dict(dropout=1.0), "dropout must be in"),
    (dict(n_embd=1024, n_head=2, fused=True), "512 is over flash attention's 256"),
    (dict(preset="llama-small", n_embd=30, n_head=2, n_head_kv=2), "must be even for rotary"),
])
def test_bad_shapes_are_refused(kwargs, message):
    kwargs = dict(dict(preset="gpt2-small", vocab_size=256, seqlen=64), **kwargs)
    with pytest.raises(ValueError, match=message):
        gpt_config(kwargs.pop("preset"), kwargs.pop("vocab_size"), kwargs.pop("seqlen"), **kwargs)


def test_training_flops_per_token():
    seqlen = 32
    config = gpt_config("gpt-mini", 256, seqlen, n_layer=2, n_embd=64, n_head=4)
    model = GPTLMHeadModel(config)
    positions = model.transformer.embeddings.position_embeddings.weight.numel()
    expected = 6 * (_numel(model) - positions) + 6 * 2 * 64 * seqlen
    assert training_flops_per_token(model, seqlen) == expected
    untied = GPTLMHeadModel(gpt_config("llama-small", 256, seqlen, n_layer=2, n_embd=64, n_head=4))
    embedding = untied.transformer.embeddings.word_embeddings.weight.numel()
    assert training_flops_per_token(untied, seqlen) == 6 * (_numel(untied) - embedding) + \
        6 * 2 * 64 * seqlen


def test_every_preset_builds():
    for name in PRESETS:
        config = gpt_config(name, 256, 64)
        with torch.device("meta"):
            GPTLMHeadModel(config, device="meta")
