"""GPTBigCode (StarCoder, SantaCoder) as a GPT configuration: GPT-2's block with learned
positions, nn.Linear (not Conv1D) projections and multi-query attention (one key/value head),
tied head.

HF's c_attn rows: multi_query [q (n_head heads); k (one head); v (one head)], which is our Wqkv
with n_head_kv=1; otherwise per head [q, k, v] (n_head, 3, head_dim). The converter keeps the
single key/value head (n_head_kv=1); a config with n_head_kv unset gets k and v repeated for
every head instead, as flash-attn's remap does.
"""

import re
from collections import OrderedDict

import torch
from einops import rearrange
from transformers import GPT2Config

from flash_attn.models.checkpoint import (
    attention_layout,
    padded_vocab_size,
    put_gpt2_top_level,
    split_layer_key,
    tie_lm_head,
)
from flash_attn.models.registry import ModelFamily, register_family


def bigcode_config_to_gpt2_config(bigcode_config):
    if getattr(bigcode_config, "add_cross_attention", False):
        raise NotImplementedError("bigcode_config_to_gpt2_config: add_cross_attention is not "
                                  "supported")
    return GPT2Config(
        vocab_size=bigcode_config.vocab_size, n_positions=bigcode_config.n_positions,
        n_embd=bigcode_config.n_embd, n_layer=bigcode_config.n_layer,
        n_head=bigcode_config.n_head, n_inner=bigcode_config.n_inner,
        activation_function=bigcode_config.activation_function,
        resid_pdrop=bigcode_config.resid_pdrop, embd_pdrop=bigcode_config.embd_pdrop,
        attn_pdrop=bigcode_config.attn_pdrop, layer_norm_epsilon=bigcode_config.layer_norm_epsilon,
        initializer_range=bigcode_config.initializer_range,
        scale_attn_weights=bigcode_config.scale_attn_weights,
        bos_token_id=bigcode_config.bos_token_id, eos_token_id=bigcode_config.eos_token_id,
        multi_query=bigcode_config.multi_query,
        n_head_kv=1 if bigcode_config.multi_query else None,
        tie_word_embeddings=getattr(bigcode_config, "tie_word_embeddings", True),
    )


_NAMES = {"ln_1": "norm1", "ln_2": "norm2", "attn.c_proj": "mixer.out_proj",
          "mlp.c_fc": "mlp.fc1", "mlp.c_proj": "mlp.fc2"}


def _split_c_attn(value, config):
    """HF c_attn rows -> (q, k, v) rows, k / v with HF's own number of heads."""
    head_dim, n_head, _ = attention_layout(config)
    if getattr(config, "multi_query", True):
        return value.split([n_head * head_dim, head_dim, head_dim], dim=0)
    return rearrange(value, "(h three d) ... -> three (h d) ...", three=3, h=n_head)


def remap_state_dict_hf_bigcode(state_dict, config):
    """HF GPTBigCodeForCausalLM state dict -> GPTLMHeadModel(config)'s."""
    head_dim, _, n_head_kv = attention_layout(config)
    vocab = padded_vocab_size(config)
    out = OrderedDict()
    for key, value in state_dict.items():
        key = re.sub(r"^transformer\.", "", key)
        if key == "bias" or re.search(r"\.attn\.(masked_)?bias$", key):  # causal-mask buffers
            continue
        if not put_gpt2_top_level(out, key, value, vocab):
            i, module, param = split_layer_key(r"h\.", key, "remap_state_dict_hf_bigcode")
            if module == "attn.c_attn":
                q, k, v = _split_c_attn(value, config)
                hf_heads_kv = k.shape[0] // head_dim
                if n_head_kv % hf_heads_kv != 0:
                    raise ValueError(f"remap_state_dict_hf_bigcode: the checkpoint has "
                                     f"{hf_heads_kv} key/value heads, config.n_head_kv is "
                                     f"{n_head_kv}")
                repeat = (n_head_kv // hf_heads_kv,) + (1,) * (k.dim() - 1)
                k, v = k.repeat(repeat), v.repeat(repeat)
                out[f"transformer.layers.{i}.mixer.Wqkv.{param}"] = torch.cat([q, k, v])
            elif module in _NAMES:
                out[f"transformer.layers.{i}.{_NAMES[module]}.{param}"] = value
            else:
                raise KeyError(f"remap_state_dict_hf_bigcode: unexpected key {key!r}")
    return tie_lm_head(out, config)


def inv_remap_state_dict_hf_bigcode(state_dict, config):
    """GPTLMHeadModel(config) state dict -> HF GPTBigCodeForCausalLM's (vocabulary padding
    removed; with multi_query the first key/value head is kept, the others being its copies)."""
    head_dim, n_head, n_head_kv = attention_layout(config)
    inverse = {v: k for k, v in _NAMES.items()}
    out = OrderedDict()
    for key, value in state_dict.items():
        if key == "transformer.embeddings.word_embeddings.weight":
            out["transformer.wte.weight"] = value[: config.vocab_size]
        elif key == "transformer.embeddings.position_embeddings.weight":
            out["transformer.wpe.weight"] = value
        elif key.startswith("transformer.ln_f."):
            out[key] = value
        elif key == "lm_head.weight":
            out[key] = value[: config.vocab_size]
        else:
            i, module, param = split_layer_key(r"transformer\.layers\.", key,
                                               "inv_remap_state_dict_hf_bigcode")
            prefix = f"transformer.h.{i}."
            if module == "mixer.Wqkv":
                q, k, v = value.split([n_head * head_dim, n_head_kv * head_dim,
                                       n_head_kv * head_dim], dim=0)
                if getattr(config, "multi_query", True):
                    value = torch.cat([q, k[:head_dim], v[:head_dim]])
                else:
                    value = rearrange(torch.stack([q, k, v]), "three (h d) ... -> (h three d) ...",
                                      h=n_head)
                out[f"{prefix}attn.c_attn.{param}"] = value
            else:
                out[f"{prefix}{inverse[module]}.{param}"] = value
    return out


def _is_bigcode(state_dict):
    """GPT-2's key names, but c_attn is an nn.Linear: (out > in) rather than Conv1D's (in, 3 in)."""
    return any(re.search(r"(^|\.)h\.\d+\.attn\.c_attn\.weight$", key)
               and value.shape[0] > value.shape[1] for key, value in state_dict.items())


register_family(ModelFamily(
    name="gpt_bigcode", module=__name__, model_types=("gpt_bigcode",),
    config_to_gpt2_config=bigcode_config_to_gpt2_config,
    remap_state_dict=remap_state_dict_hf_bigcode,
    inv_remap_state_dict=inv_remap_state_dict_hf_bigcode, matches=_is_bigcode))
