"""Falcon as a GPT configuration: rotary embeddings (rotate-half), multi-query or grouped
key/value heads, attention and MLP in parallel, no biases by default, tied head.

Two decoder architectures (HF FalconConfig.new_decoder_architecture; the remote-code configs
"RefinedWebModel" = old, "RefinedWeb" = new):
- old (Falcon-7B, -RW): one key/value head with multi_query, else as many as query heads;
  parallel_attn: attention and MLP read one input_layernorm (our tied-norm ParallelBlock),
  otherwise a sequential pre-norm block (input_layernorm, post_attention_layernorm).
- new (Falcon-40B / -180B): num_kv_heads grouped heads, attention and MLP in parallel from their
  own norms ln_attn / ln_mlp (num_ln_in_parallel_attn 2, the default) or one input_layernorm.

query_key_value's rows are grouped by key/value head: for each of the n_head_kv groups, its
n_head / n_head_kv query heads, then its key head, then its value head. The old layouts are the
same with one group (multi_query) or n_head groups of one query head each, so one regrouping
to our [all q; all k; all v] serves every variant.
"""

import re
from collections import OrderedDict

import torch
from einops import rearrange
from transformers import GPT2Config

from flash_attn.models.checkpoint import (
    attention_layout,
    pad_vocab,
    padded_vocab_size,
    split_layer_key,
    tie_lm_head,
)
from flash_attn.models.registry import ModelFamily, key_pattern, register_family

_ACTIVATIONS = ("gelu", "gelu_new", "gelu_fast", "gelu_pytorch_tanh", "relu")


def _first(config, *names, default=None):
    """The first of names the config has (HF's FalconConfig and the remote-code ones differ)."""
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


def falcon_config_to_gpt2_config(falcon_config):
    """FalconConfig (or the remote-code RefinedWeb / RefinedWebModel config) -> GPT2Config."""
    if getattr(falcon_config, "alibi", False):
        raise NotImplementedError("falcon_config_to_gpt2_config: alibi is not supported (Falcon "
                                  "adds ALiBi before the 1/sqrt(d) scale); only rotary is")
    rope = getattr(falcon_config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise NotImplementedError(f"falcon_config_to_gpt2_config: rope type "
                                  f"{rope['rope_type']!r} is not supported")
    activation = getattr(falcon_config, "activation", "gelu")
    if activation not in _ACTIVATIONS:
        raise NotImplementedError(f"falcon_config_to_gpt2_config: activation {activation!r} is "
                                  f"not supported")
    hidden_size = _first(falcon_config, "hidden_size", "n_embed")
    n_head = _first(falcon_config, "num_attention_heads", "n_head")
    new_arch = _first(falcon_config, "new_decoder_architecture",
                      default=getattr(falcon_config, "model_type", None) == "RefinedWeb")
    if new_arch:
        n_head_kv = _first(falcon_config, "num_kv_heads", "n_head_kv", default=n_head)
        tied_norm = _first(falcon_config, "num_ln_in_parallel_attn", default=2) == 1
    else:
        n_head_kv = 1 if getattr(falcon_config, "multi_query", True) else n_head
        tied_norm = True
    bias = getattr(falcon_config, "bias", False)
    return GPT2Config(
        vocab_size=falcon_config.vocab_size,
        n_positions=0,  # rotary
        n_embd=hidden_size,
        n_layer=_first(falcon_config, "num_hidden_layers", "n_layer"),
        n_head=n_head,
        n_head_kv=n_head_kv,
        n_inner=_first(falcon_config, "ffn_hidden_size", default=4 * hidden_size),
        activation_function=activation,
        resid_pdrop=_first(falcon_config, "hidden_dropout", default=0.0),
        embd_pdrop=0.0,
        attn_pdrop=_first(falcon_config, "attention_dropout", default=0.0),
        layer_norm_epsilon=falcon_config.layer_norm_epsilon,
        initializer_range=falcon_config.initializer_range,
        bos_token_id=falcon_config.bos_token_id,
        eos_token_id=falcon_config.eos_token_id,
        rotary_emb_fraction=1.0,
        rotary_emb_base=rope.get("rope_theta", getattr(falcon_config, "rope_theta", 10000.0)),
        rotary_emb_interleaved=False,
        parallel_block=bool(new_arch or getattr(falcon_config, "parallel_attn", True)),
        parallel_block_tied_norm=tied_norm,
        qkv_proj_bias=bias, out_proj_bias=bias, mlp_fc1_bias=bias, mlp_fc2_bias=bias,
        tie_word_embeddings=getattr(falcon_config, "tie_word_embeddings", True),
    )


_NAMES = {"input_layernorm": "norm1", "ln_attn": "norm1", "post_attention_layernorm": "norm2",
          "ln_mlp": "norm2", "self_attention.dense": "mixer.out_proj",
          "mlp.dense_h_to_4h": "mlp.fc1", "mlp.dense_4h_to_h": "mlp.fc2"}


def remap_state_dict_hf_falcon(state_dict, config):
    """HF FalconForCausalLM state dict -> GPTLMHeadModel(config)'s (config from
    falcon_config_to_gpt2_config)."""
    head_dim, _, n_head_kv = attention_layout(config)
    vocab = padded_vocab_size(config)
    out = OrderedDict()
    for key, value in state_dict.items():
        key = re.sub(r"^transformer\.", "", key)
        if key.endswith("inv_freq"):
            continue
        if key == "word_embeddings.weight":
            out["transformer.embeddings.word_embeddings.weight"] = pad_vocab(value, vocab)
        elif key in ("lm_head.weight", "lm_head.bias"):
            out[key] = pad_vocab(value, vocab)
        elif key.startswith("ln_f."):
            out["transformer." + key] = value
        else:
            i, module, param = split_layer_key(r"h\.", key, "remap_state_dict_hf_falcon")
            if module == "self_attention.query_key_value":
                groups = rearrange(value, "(g r d) ... -> g r d ...", g=n_head_kv, d=head_dim)
                q, k, v = groups[:, :-2], groups[:, -2], groups[:, -1]
                out[f"transformer.layers.{i}.mixer.Wqkv.{param}"] = torch.cat([
                    rearrange(q, "g r d ... -> (g r d) ..."),
                    rearrange(k, "g d ... -> (g d) ..."), rearrange(v, "g d ... -> (g d) ...")])
            elif module in _NAMES:
                out[f"transformer.layers.{i}.{_NAMES[module]}.{param}"] = value
            else:
                raise KeyError(f"remap_state_dict_hf_falcon: unexpected key {key!r}")
    return tie_lm_head(out, config)


register_family(ModelFamily(
    name="falcon", module=__name__, model_types=("falcon", "RefinedWeb", "RefinedWebModel"),
    config_to_gpt2_config=falcon_config_to_gpt2_config,
    remap_state_dict=remap_state_dict_hf_falcon,
    matches=key_pattern(r"(^|\.)h\.\d+\.self_attention\.query_key_value\.")))
