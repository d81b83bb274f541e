import json
import re

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from flash_attn.models.checkpoint import combine_state_dicts_tp
from flash_attn.models.gpt import GPTLMHeadModel
from flash_attn.models.llama import (
    config_from_checkpoint,
    config_from_meta_checkpoint,
    inv_remap_state_dict_hf_llama,
    llama_config_to_gpt2_config,
    remap_state_dict_hf_llama,
    remap_state_dict_meta_llama,
    state_dicts_from_checkpoint,
)

VOCAB = 100


def _llama_config(**kwargs):
    # initializer_range 0.2: a random model whose greedy choices are clear-cut (see test_gpt).
    base = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=96, vocab_size=VOCAB, initializer_range=0.2, rms_norm_eps=1e-5,
                max_position_embeddings=128, bos_token_id=0, eos_token_id=1, pad_token_id=0)
    base.update(kwargs)
    return LlamaConfig(**base)


def _hf_and_ours(llama_config, **flags):
    torch.manual_seed(0)
    hf = LlamaForCausalLM(llama_config).eval()
    config = llama_config_to_gpt2_config(llama_config)
    for name, value in flags.items():
        setattr(config, name, value)
    ours = GPTLMHeadModel(config).eval()
    ours.load_state_dict(remap_state_dict_hf_llama(hf.state_dict(), config))
    return hf, ours, config


@pytest.mark.parametrize("options", [{}, {"num_key_value_heads": 4},
                                     {"tie_word_embeddings": True, "attention_bias": True},
                                     {"rope_theta": 500000.0}])
def test_llama_matches_hf(options):
    hf, ours, config = _hf_and_ours(_llama_config(**options))
    assert config.rotary_emb_base == options.get("rope_theta", 10000.0)
    ids = torch.randint(0, VOCAB, (2, 20))
    with torch.no_grad():
        out_hf = hf(ids, labels=ids)
        logits = ours(ids).logits
    assert (logits - out_hf.logits).abs().max().item() <= 1e-4
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    assert abs(loss.item() - out_hf.loss.item()) <= 1e-5


def test_llama_padded_vocab_and_inverse_remap():
    hf, ours, config = _hf_and_ours(_llama_config(), pad_vocab_size_multiple=64)
    assert ours.lm_head.weight.shape[0] == 128
    back = inv_remap_state_dict_hf_llama(ours.state_dict(), config)
    reference = hf.state_dict()
    assert set(back) == set(reference)
    for key, value in reference.items():
        assert torch.equal(back[key], value), key


def test_llama_greedy_generation_matches_hf():
    hf, ours, _ = _hf_and_ours(_llama_config())
    torch.manual_seed(1)
    prompt = torch.randint(2, VOCAB, (2, 7))
    with torch.no_grad():
        expected = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_length=28,
                               do_sample=False, eos_token_id=None, pad_token_id=0)
    assert len(expected[0, 7:].unique()) > 3
    assert torch.equal(ours.generate(prompt, max_length=28), expected)


def test_unsupported_llama_configs_raise():
    with pytest.raises(NotImplementedError, match="rope"):
        llama_config_to_gpt2_config(_llama_config(rope_scaling={"rope_type": "linear", "factor": 2.0}))
    with pytest.raises(NotImplementedError, match="head_dim"):
        llama_config_to_gpt2_config(_llama_config(head_dim=32))


@pytest.mark.gpu
def test_llama_fused_matches_hf_gpu():
    llama_config = _llama_config(hidden_size=512, num_attention_heads=8, num_key_value_heads=2,
                                 intermediate_size=1024, vocab_size=1000, initializer_range=0.02)
    torch.manual_seed(0)
    hf = LlamaForCausalLM(llama_config).to("cuda").eval()
    config = llama_config_to_gpt2_config(llama_config)
    config.update(dict(use_flash_attn=True, fused_bias_fc=True, fused_dropout_add_ln=True,
                       residual_in_fp32=True))
    ours = GPTLMHeadModel(config, device="cuda", dtype=torch.bfloat16).eval()
    ours.load_state_dict(remap_state_dict_hf_llama(hf.state_dict(), config))
    hf_lowp = LlamaForCausalLM(llama_config).to("cuda", torch.bfloat16).eval()
    hf_lowp.load_state_dict(hf.state_dict())
    ids = torch.randint(0, 1000, (2, 300), device="cuda")
    with torch.no_grad():
        ref = hf(ids).logits.float()
        err = (ours(ids).logits.float() - ref).abs().max().item()
        base = (hf_lowp(ids).logits.float() - ref).abs().max().item()
    # flash-attn's model-test bound: 3x the error of the bf16 HF model.
    assert err <= 3 * base + 1e-3, (err, base)


# ----------------------------------------------------------------------------------------------
# Meta's original checkpoints: params.json + consolidated.NN.pth, one per model-parallel rank.
# ----------------------------------------------------------------------------------------------

META_PARAMS = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": VOCAB,
               "multiple_of": 32, "ffn_dim_multiplier": None, "norm_eps": 1e-5,
               "rope_theta": 10000.0}


def _hf_to_meta(hf_state_dict, n_heads, n_kv_heads):
    """An HF Llama state dict in Meta's layout: q / k rows back in Meta's interleaved rotary
    order (the inverse of the permutation in HF's convert_llama_weights_to_hf.py)."""

    def interleave(w, heads):
        half = w.shape[0] // heads // 2
        return w.view(heads, 2, half, w.shape[1]).transpose(1, 2).reshape(w.shape)

    meta = {"tok_embeddings.weight": hf_state_dict["model.embed_tokens.weight"],
            "norm.weight": hf_state_dict["model.norm.weight"],
            "output.weight": hf_state_dict["lm_head.weight"],
            "rope.freqs": torch.ones(8)}  # stored by Llama 1 checkpoints
    names = {"attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
             "feed_forward.w1": "mlp.gate_proj", "feed_forward.w2": "mlp.down_proj",
             "feed_forward.w3": "mlp.up_proj", "attention_norm": "input_layernorm",
             "ffn_norm": "post_attention_layernorm"}
    for i in range(META_PARAMS["n_layers"]):
        hf = f"model.layers.{i}."
        meta[f"layers.{i}.attention.wq.weight"] = interleave(
            hf_state_dict[hf + "self_attn.q_proj.weight"], n_heads)
        meta[f"layers.{i}.attention.wk.weight"] = interleave(
            hf_state_dict[hf + "self_attn.k_proj.weight"], n_kv_heads)
        for meta_name, hf_name in names.items():
            meta[f"layers.{i}.{meta_name}.weight"] = hf_state_dict[f"{hf}{hf_name}.weight"]
    return meta


def _shard_like_fairscale(meta, world_size, embedding_dim):
    """Meta's model-parallel split: column-parallel (rows split) wq / wk / wv / w1 / w3 /
    output, row-parallel (columns split) wo / w2, the embedding split along embedding_dim,
    norms replicated."""
    shards = [{} for _ in range(world_size)]
    for key, value in meta.items():
        if re.search(r"attention\.w[qkv]\.|feed_forward\.w[13]\.|^output\.", key):
            parts = value.chunk(world_size, dim=0)
        elif re.search(r"attention\.wo\.|feed_forward\.w2\.", key):
            parts = value.chunk(world_size, dim=1)
        elif key == "tok_embeddings.weight":
            parts = value.chunk(world_size, dim=embedding_dim)
        else:
            parts = [value] * world_size
        for shard, part in zip(shards, parts):
            shard[key] = part.clone()
    return shards


@pytest.mark.parametrize("world_size,embedding_dim,pad_multiple", [
    (1, 1, 1),
    (2, 1, 1),    # Llama 1 / 2: ParallelEmbedding splits the embedding dim
    (2, 0, 16),   # Llama 3: VocabParallelEmbedding splits the rows; padded vocabulary
])
def test_llama_from_meta_checkpoint_shards(tmp_path, world_size, embedding_dim, pad_multiple):
    folder = tmp_path / "7B"
    folder.mkdir()
    (folder / "params.json").write_text(json.dumps(META_PARAMS))
    llama_config = config_from_checkpoint(tmp_path, "7B")
    assert llama_config.intermediate_size == 192  # 2/3 of 4 * 64, rounded up to 32
    assert (llama_config.num_key_value_heads, llama_config.vocab_size) == (2, VOCAB)
    llama_config.initializer_range = 0.2
    torch.manual_seed(0)
    hf = LlamaForCausalLM(llama_config).eval()  # the unsharded model
    meta = _hf_to_meta(hf.state_dict(), n_heads=4, n_kv_heads=2)
    for rank, shard in enumerate(_shard_like_fairscale(meta, world_size, embedding_dim)):
        torch.save(shard, folder / f"consolidated.{rank:02d}.pth")

    config = llama_config_to_gpt2_config(llama_config)
    config.pad_vocab_size_multiple = pad_multiple
    shards = state_dicts_from_checkpoint(tmp_path, "7B")
    assert len(shards) == world_size
    merged = combine_state_dicts_tp([remap_state_dict_meta_llama(s, config) for s in shards],
                                    config)
    ours = GPTLMHeadModel(config).eval()
    ours.load_state_dict(merged)  # strict
    ids = torch.randint(0, VOCAB, (2, 20))
    with torch.no_grad():
        assert (ours(ids).logits[..., :VOCAB] - hf(ids).logits).abs().max().item() <= 1e-4


def test_llama_config_from_hf_checkpoint(tmp_path):
    _llama_config(intermediate_size=192).save_pretrained(tmp_path / "7B-hf")
    config = config_from_checkpoint(tmp_path, "7B", checkpoint_format="hf")
    assert config.intermediate_size == 192 and config.num_key_value_heads == 2
    with pytest.raises(ValueError, match="checkpoint_format"):
        config_from_checkpoint(tmp_path, "7B", checkpoint_format="gguf")


def test_llama_meta_checkpoint_errors(tmp_path):
    folder = tmp_path / "7B"
    folder.mkdir()
    with pytest.raises(FileNotFoundError, match="consolidated"):
        state_dicts_from_checkpoint(tmp_path, "7B")
    (folder / "params.json").write_text(json.dumps(dict(META_PARAMS, use_scaled_rope=True)))
    with pytest.raises(NotImplementedError, match="use_scaled_rope"):
        config_from_meta_checkpoint(tmp_path, "7B")
