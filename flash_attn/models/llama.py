"""Llama as a GPT configuration: RMSNorm, SwiGLU MLP, rotary embeddings, grouped-query
attention, no biases, untied head. HF LlamaForCausalLM checkpoints map onto GPTLMHeadModel.

Rotary layout: HF's q/k projections are ordered for the "rotate half" (non-interleaved) form, so
the config keeps rotary_emb_interleaved=False and the weights need no permutation.
"""

import re
from collections import OrderedDict

import torch
from transformers import GPT2Config

from flash_attn.models.gpt import pad_vocab, padded_vocab_size, split_layer_key


def _rope_theta(llama_config):
    params = getattr(llama_config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    scaling = getattr(llama_config, "rope_scaling", None)
    if rope_type != "default" or (scaling and scaling.get("rope_type", "default") != "default"):
        raise NotImplementedError(f"llama_config_to_gpt2_config: rope type {rope_type!r} "
                                  f"(rope scaling) is not supported; only plain RoPE is")
    return params.get("rope_theta", getattr(llama_config, "rope_theta", 10000.0))


def llama_config_to_gpt2_config(llama_config):
    """LlamaConfig -> GPT2Config with the flags that make GPTLMHeadModel a Llama."""
    head_dim = getattr(llama_config, "head_dim", None)
    if head_dim and head_dim * llama_config.num_attention_heads != llama_config.hidden_size:
        raise NotImplementedError("head_dim * num_attention_heads != hidden_size is not supported")
    activation = {"silu": "swiglu", "swish": "swiglu", "gelu": "geglu"}.get(llama_config.hidden_act)
    if activation is None:
        raise NotImplementedError(f"hidden_act {llama_config.hidden_act!r} is not supported")
    attention_bias = getattr(llama_config, "attention_bias", False)
    mlp_bias = getattr(llama_config, "mlp_bias", False)
    return GPT2Config(
        vocab_size=llama_config.vocab_size,
        n_positions=0,  # positions come from rotary embeddings
        n_embd=llama_config.hidden_size,
        n_layer=llama_config.num_hidden_layers,
        n_head=llama_config.num_attention_heads,
        n_head_kv=getattr(llama_config, "num_key_value_heads", None),
        n_inner=llama_config.intermediate_size,
        activation_function=activation,
        mlp_multiple_of=1,  # intermediate_size is used as given
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=getattr(llama_config, "attention_dropout", 0.0),
        layer_norm_epsilon=llama_config.rms_norm_eps,
        initializer_range=llama_config.initializer_range,
        bos_token_id=llama_config.bos_token_id,
        eos_token_id=llama_config.eos_token_id,
        pad_token_id=llama_config.pad_token_id,
        rms_norm=True,
        rotary_emb_fraction=1.0,
        rotary_emb_base=_rope_theta(llama_config),
        rotary_emb_interleaved=False,
        tie_word_embeddings=getattr(llama_config, "tie_word_embeddings", False),
        qkv_proj_bias=attention_bias,
        out_proj_bias=attention_bias,
        mlp_fc1_bias=mlp_bias,
        mlp_fc2_bias=mlp_bias,
        lm_head_bias=False,
    )


_LAYER_NAMES = {
    "input_layernorm": "norm1",
    "post_attention_layernorm": "norm2",
    "self_attn.o_proj": "mixer.out_proj",
    "mlp.down_proj": "mlp.fc2",
}


def remap_state_dict_hf_llama(state_dict, config):
    """HF LlamaForCausalLM state dict -> GPTLMHeadModel(config)'s (config from
    llama_config_to_gpt2_config). q/k/v are stacked into Wqkv; [up; gate] into fc1 (the gated
    MLP reads the first half as the value and the second as the gate)."""
    vocab_size = padded_vocab_size(config)
    out, pieces = OrderedDict(), {}
    for key, value in state_dict.items():
        key = re.sub(r"^model\.", "", key)
        if key == "embed_tokens.weight":
            out["transformer.embeddings.word_embeddings.weight"] = pad_vocab(value, vocab_size)
        elif key == "lm_head.weight":
            out["lm_head.weight"] = pad_vocab(value, vocab_size)
        elif key == "norm.weight":
            out["transformer.ln_f.weight"] = value
        elif key.endswith("rotary_emb.inv_freq"):
            continue
        else:
            i, module, param = split_layer_key(r"layers\.", key, "remap_state_dict_hf_llama")
            if module in _LAYER_NAMES:
                out[f"transformer.layers.{i}.{_LAYER_NAMES[module]}.{param}"] = value
            else:  # q/k/v and gate/up, stacked below
                pieces[(i, module, param)] = value
    for i in range(config.n_layer):
        for param in ("weight", "bias"):
            qkv = [pieces.pop((str(i), f"self_attn.{p}_proj", param), None) for p in "qkv"]
            if qkv[0] is not None:
                out[f"transformer.layers.{i}.mixer.Wqkv.{param}"] = torch.cat(qkv, dim=0)
            up = pieces.pop((str(i), "mlp.up_proj", param), None)
            gate = pieces.pop((str(i), "mlp.gate_proj", param), None)
            if up is not None:
                out[f"transformer.layers.{i}.mlp.fc1.{param}"] = torch.cat([up, gate], dim=0)
    if pieces:
        raise KeyError(f"remap_state_dict_hf_llama: unexpected keys {sorted(pieces)[:4]}")
    if config.tie_word_embeddings or "lm_head.weight" not in out:
        out["lm_head.weight"] = out["transformer.embeddings.word_embeddings.weight"]
    return out


def inv_remap_state_dict_hf_llama(state_dict, config):
    """GPTLMHeadModel(config) state dict -> HF LlamaForCausalLM's (vocabulary padding removed)."""
    head_dim = config.n_embd // config.n_head
    n_head_kv = getattr(config, "n_head_kv", None) or config.n_head
    q_dim, kv_dim = config.n_head * head_dim, n_head_kv * head_dim
    inverse = {v: k for k, v in _LAYER_NAMES.items()}
    out = OrderedDict()
    for key, value in state_dict.items():
        if key == "transformer.embeddings.word_embeddings.weight":
            out["model.embed_tokens.weight"] = value[: config.vocab_size]
        elif key == "lm_head.weight":
            out["lm_head.weight"] = value[: config.vocab_size]
        elif key == "transformer.ln_f.weight":
            out["model.norm.weight"] = value
        else:
            i, module, param = split_layer_key(r"transformer\.layers\.", key,
                                               "inv_remap_state_dict_hf_llama")
            prefix = f"model.layers.{i}."
            if module == "mixer.Wqkv":
                q, k, v = value.split([q_dim, kv_dim, kv_dim], dim=0)
                for name, t in zip("qkv", (q, k, v)):
                    out[f"{prefix}self_attn.{name}_proj.{param}"] = t
            elif module == "mlp.fc1":
                up, gate = value.chunk(2, dim=0)
                out[f"{prefix}mlp.up_proj.{param}"] = up
                out[f"{prefix}mlp.gate_proj.{param}"] = gate
            else:
                out[f"{prefix}{inverse[module]}.{param}"] = value
    return out
