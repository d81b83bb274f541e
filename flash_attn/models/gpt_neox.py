"""GPT-NeoX (Pythia) as a GPT configuration: partial rotary (rotate-half layout), attention and
MLP in parallel from separate norms (use_parallel_residual), untied head."""

import re
from collections import OrderedDict

from einops import rearrange
from transformers import GPT2Config

from flash_attn.models.checkpoint import pad_vocab, padded_vocab_size, split_layer_key
from flash_attn.models.registry import ModelFamily, key_pattern, register_family


def gpt_neox_config_to_gpt2_config(neox_config):
    rope = getattr(neox_config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise NotImplementedError(f"rope type {rope.get('rope_type')!r} is not supported")
    rotary_fraction = rope.get("partial_rotary_factor", getattr(neox_config, "rotary_pct", 1.0))
    activation = {"gelu": "gelu", "gelu_new": "gelu_new", "gelu_fast": "gelu_fast",
                  "gelu_pytorch_tanh": "gelu_pytorch_tanh"}.get(neox_config.hidden_act)
    if activation is None:
        raise NotImplementedError(f"hidden_act {neox_config.hidden_act!r} is not supported")
    bias = getattr(neox_config, "attention_bias", True)
    return GPT2Config(
        vocab_size=neox_config.vocab_size, n_positions=0, n_embd=neox_config.hidden_size,
        n_layer=neox_config.num_hidden_layers, n_head=neox_config.num_attention_heads,
        n_inner=neox_config.intermediate_size, activation_function=activation,
        resid_pdrop=neox_config.hidden_dropout, embd_pdrop=0.0,
        attn_pdrop=neox_config.attention_dropout, layer_norm_epsilon=neox_config.layer_norm_eps,
        initializer_range=neox_config.initializer_range, bos_token_id=neox_config.bos_token_id,
        eos_token_id=neox_config.eos_token_id, rotary_emb_fraction=rotary_fraction,
        rotary_emb_base=rope.get("rope_theta", getattr(neox_config, "rotary_emb_base", 10000.0)),
        rotary_emb_interleaved=False, parallel_block=neox_config.use_parallel_residual,
        parallel_block_tied_norm=False, qkv_proj_bias=bias, out_proj_bias=bias,
        tie_word_embeddings=getattr(neox_config, "tie_word_embeddings", False),
    )


_NAMES = {"input_layernorm": "norm1", "post_attention_layernorm": "norm2",
          "attention.dense": "mixer.out_proj", "mlp.dense_h_to_4h": "mlp.fc1",
          "mlp.dense_4h_to_h": "mlp.fc2"}


def remap_state_dict_hf_gpt_neox(state_dict, config):
    """HF GPTNeoXForCausalLM -> GPTLMHeadModel. NeoX's fused qkv is laid out per head
    ([q, k, v] of head 0, then head 1, ...); ours is [all q; all k; all v]."""
    vocab = padded_vocab_size(config)
    out = OrderedDict()
    for key, value in state_dict.items():
        key = re.sub(r"^gpt_neox\.", "", key)
        if re.search(r"attention\.(masked_)?bias$|rotary_emb\.inv_freq$", key):
            continue
        if key == "embed_in.weight":
            out["transformer.embeddings.word_embeddings.weight"] = pad_vocab(value, vocab)
        elif key in ("embed_out.weight", "lm_head.weight"):
            out["lm_head.weight"] = pad_vocab(value, vocab)
        elif key.startswith("final_layer_norm."):
            out["transformer.ln_f." + key.split(".", 1)[1]] = value
        else:
            i, module, param = split_layer_key(r"layers\.", key, "remap_state_dict_hf_gpt_neox")
            if module == "attention.query_key_value":
                value = rearrange(value, "(h three d) ... -> (three h d) ...", three=3,
                                  h=config.n_head)
                out[f"transformer.layers.{i}.mixer.Wqkv.{param}"] = value
            else:
                out[f"transformer.layers.{i}.{_NAMES[module]}.{param}"] = value
    if config.tie_word_embeddings:
        out["lm_head.weight"] = out["transformer.embeddings.word_embeddings.weight"]
    return out


register_family(ModelFamily(
    name="gpt_neox", module=__name__, model_types=("gpt_neox",),
    config_to_gpt2_config=gpt_neox_config_to_gpt2_config,
    remap_state_dict=remap_state_dict_hf_gpt_neox,
    matches=key_pattern(r"\.attention\.query_key_value\.")))
