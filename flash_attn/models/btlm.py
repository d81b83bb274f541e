"""BTLM (Cerebras btlm-3b-8k, remote-code checkpoints, model_type "btlm") as a GPT
configuration: GPT-2's block and Conv1D layout with ALiBi (or learned positions), a SwiGLU MLP
(c_fc the value, c_fc2 the gate: c_fc(x) * silu(c_fc2(x))) and muP scaling: embeddings x
mup_embeddings_scale, attention scores / d (not sqrt(d)) with mup_scale_qk_dot_by_d, logits x
mup_output_alpha * mup_width_scale. Tied head.
"""

import re
from collections import OrderedDict

import torch
from transformers import GPT2Config

from flash_attn.models.checkpoint import (padded_vocab_size, put_gpt2_top_level, split_layer_key,
                                          tie_lm_head)
from flash_attn.models.registry import ModelFamily, key_pattern, register_family


def btlm_config_to_gpt2_config(btlm_config):
    position_embedding_type = getattr(btlm_config, "position_embedding_type", "learned")
    if position_embedding_type not in ("learned", "alibi"):
        raise NotImplementedError(f"btlm_config_to_gpt2_config: position_embedding_type "
                                  f"{position_embedding_type!r} is not supported")
    if getattr(btlm_config, "alibi_scaling", None) is not None:
        raise NotImplementedError("btlm_config_to_gpt2_config: alibi_scaling is not supported")
    alibi = position_embedding_type == "alibi"
    return GPT2Config(
        vocab_size=btlm_config.vocab_size,
        n_positions=0 if alibi else btlm_config.n_positions,
        n_embd=btlm_config.n_embd, n_layer=btlm_config.n_layer, n_head=btlm_config.n_head,
        n_inner=btlm_config.n_inner, activation_function=btlm_config.activation_function,
        mlp_multiple_of=1,  # n_inner is used as given
        resid_pdrop=btlm_config.resid_pdrop, embd_pdrop=btlm_config.embd_pdrop,
        attn_pdrop=btlm_config.attn_pdrop, layer_norm_epsilon=btlm_config.layer_norm_epsilon,
        initializer_range=btlm_config.initializer_range,
        scale_attn_weights=getattr(btlm_config, "scale_attn_weights", True),
        scale_attn_by_inverse_layer_idx=getattr(btlm_config, "scale_attn_by_inverse_layer_idx",
                                                False),
        bos_token_id=btlm_config.bos_token_id, eos_token_id=btlm_config.eos_token_id,
        use_alibi=alibi,
        mup_width_scale=btlm_config.mup_width_scale,
        mup_embeddings_multiplier=btlm_config.mup_embeddings_scale,
        mup_output_multiplier=btlm_config.mup_output_alpha,
        mup_scale_qk_dot_by_d=btlm_config.mup_scale_qk_dot_by_d,
        tie_word_embeddings=getattr(btlm_config, "tie_word_embeddings", True),
    )


_NAMES = {"ln_1": "norm1", "ln_2": "norm2", "attn.c_attn": "mixer.Wqkv",
          "attn.c_proj": "mixer.out_proj", "mlp.c_proj": "mlp.fc2"}


def remap_state_dict_hf_btlm(state_dict, config):
    """BTLM's (remote-code BTLMLMHeadModel) state dict -> GPTLMHeadModel(config)'s. Conv1D
    weights are (in, out): transposed; [c_fc; c_fc2] become fc1 ([value; gate]). The ALiBi
    slopes are not stored (the model derives them from the number of heads)."""
    vocab = padded_vocab_size(config)
    out, fc1 = OrderedDict(), {}
    for key, value in state_dict.items():
        key = re.sub(r"^transformer\.", "", key)
        if key == "relative_pe.slopes" or re.search(r"\.attn\.(masked_)?bias$", key):
            continue
        if not put_gpt2_top_level(out, key, value, vocab):
            i, module, param = split_layer_key(r"h\.", key, "remap_state_dict_hf_btlm")
            if param == "weight" and not module.startswith("ln_"):
                value = value.t().contiguous()
            if module in ("mlp.c_fc", "mlp.c_fc2"):
                fc1[(i, module, param)] = value
            elif module in _NAMES:
                out[f"transformer.layers.{i}.{_NAMES[module]}.{param}"] = value
            else:
                raise KeyError(f"remap_state_dict_hf_btlm: unexpected key {key!r}")
    for i, param in sorted({(i, p) for i, _, p in fc1}):
        parts = [fc1.pop((i, "mlp.c_fc", param)), fc1.pop((i, "mlp.c_fc2", param), None)]
        out[f"transformer.layers.{i}.mlp.fc1.{param}"] = torch.cat(
            [p for p in parts if p is not None])
    return tie_lm_head(out, config)


register_family(ModelFamily(
    name="btlm", module=__name__, model_types=("btlm",),
    config_to_gpt2_config=btlm_config_to_gpt2_config, remap_state_dict=remap_state_dict_hf_btlm,
    matches=key_pattern(r"(^|\.)relative_pe\.slopes$|\.mlp\.c_fc2\.")))
