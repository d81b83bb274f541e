"""OPT as a GPT configuration: learned positions (HF offsets them by 2: the remap drops those two
rows), ReLU MLP, tied head; OPT-350m is post-norm with word embeddings in a smaller space
(word_embed_proj_dim, projected in and out)."""

import re
from collections import OrderedDict

from transformers import GPT2Config

from flash_attn.models.checkpoint import (
    pad_vocab,
    padded_vocab_size,
    split_layer_key,
    stack_qkv,
    tie_lm_head,
)
from flash_attn.models.registry import ModelFamily, key_pattern, register_family

_POSITION_OFFSET = 2


def opt_config_to_gpt2_config(opt_config):
    if getattr(opt_config, "_remove_final_layer_norm", False):
        raise NotImplementedError("_remove_final_layer_norm is not supported")
    proj = getattr(opt_config, "word_embed_proj_dim", None)
    return GPT2Config(
        vocab_size=opt_config.vocab_size, n_positions=opt_config.max_position_embeddings,
        n_embd=opt_config.hidden_size, n_layer=opt_config.num_hidden_layers,
        n_head=opt_config.num_attention_heads, n_inner=opt_config.ffn_dim,
        activation_function=opt_config.activation_function, resid_pdrop=opt_config.dropout,
        embd_pdrop=opt_config.dropout, attn_pdrop=opt_config.attention_dropout,
        layer_norm_epsilon=1e-5, initializer_range=opt_config.init_std,
        bos_token_id=opt_config.bos_token_id, eos_token_id=opt_config.eos_token_id,
        pad_token_id=opt_config.pad_token_id, prenorm=opt_config.do_layer_norm_before,
        word_embed_proj_dim=proj if proj != opt_config.hidden_size else None,
        qkv_proj_bias=getattr(opt_config, "enable_bias", True),
        out_proj_bias=getattr(opt_config, "enable_bias", True),
        mlp_fc1_bias=getattr(opt_config, "enable_bias", True),
        mlp_fc2_bias=getattr(opt_config, "enable_bias", True),
        tie_word_embeddings=getattr(opt_config, "tie_word_embeddings", True),
    )


def remap_state_dict_hf_opt(state_dict, config):
    """HF OPTForCausalLM -> GPTLMHeadModel."""
    vocab = padded_vocab_size(config)
    names = {"self_attn_layer_norm": "norm1", "final_layer_norm": "norm2",
             "self_attn.out_proj": "mixer.out_proj", "fc1": "mlp.fc1", "fc2": "mlp.fc2"}
    out, qkv = OrderedDict(), {}
    for key, value in state_dict.items():
        key = re.sub(r"^(model\.)?decoder\.", "", key)
        if key == "embed_tokens.weight":
            out["transformer.embeddings.word_embeddings.weight"] = pad_vocab(value, vocab)
        elif key == "embed_positions.weight":
            out["transformer.embeddings.position_embeddings.weight"] = value[_POSITION_OFFSET:]
        elif key == "project_in.weight":
            out["transformer.embeddings.project_in.weight"] = value
        elif key == "project_out.weight":
            out["project_out.weight"] = value
        elif key.startswith("final_layer_norm."):
            out["transformer.ln_f." + key.split(".", 1)[1]] = value
        elif key == "lm_head.weight":
            out[key] = pad_vocab(value, vocab)
        else:
            i, module, param = split_layer_key(r"layers\.", key, "remap_state_dict_hf_opt")
            if module in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
                qkv[(i, module[10], param)] = value
            else:
                out[f"transformer.layers.{i}.{names[module]}.{param}"] = value
    stack_qkv(out, qkv)
    return tie_lm_head(out, config)


register_family(ModelFamily(
    name="opt", module=__name__, model_types=("opt",),
    config_to_gpt2_config=opt_config_to_gpt2_config, remap_state_dict=remap_state_dict_hf_opt,
    matches=key_pattern(r"(^|\.)decoder\.layers\.")))
