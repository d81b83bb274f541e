"""GPT-J as a GPT configuration: interleaved (rotate-every-two) rotary on the first rotary_dim
features of each head, attention and MLP in parallel from one shared norm, no attention biases,
untied head with a bias."""

import re
from collections import OrderedDict

from transformers import GPT2Config

from flash_attn.models.checkpoint import pad_vocab, padded_vocab_size, split_layer_key, stack_qkv
from flash_attn.models.registry import ModelFamily, key_pattern, register_family


def gptj_config_to_gpt2_config(gptj_config):
    head_dim = gptj_config.n_embd // gptj_config.n_head
    return GPT2Config(
        vocab_size=gptj_config.vocab_size, n_positions=0, n_embd=gptj_config.n_embd,
        n_layer=gptj_config.n_layer, n_head=gptj_config.n_head, n_inner=gptj_config.n_inner,
        activation_function=gptj_config.activation_function, resid_pdrop=gptj_config.resid_pdrop,
        embd_pdrop=gptj_config.embd_pdrop, attn_pdrop=gptj_config.attn_pdrop,
        layer_norm_epsilon=gptj_config.layer_norm_epsilon,
        initializer_range=gptj_config.initializer_range, bos_token_id=gptj_config.bos_token_id,
        eos_token_id=gptj_config.eos_token_id,
        rotary_emb_fraction=(gptj_config.rotary_dim or head_dim) / head_dim,
        rotary_emb_interleaved=True, parallel_block=True, parallel_block_tied_norm=True,
        qkv_proj_bias=False, out_proj_bias=False, lm_head_bias=True,
        tie_word_embeddings=False,
    )


def remap_state_dict_hf_gptj(state_dict, config):
    """HF GPTJForCausalLM -> GPTLMHeadModel (q/k/v stacked into Wqkv, vocabulary padded)."""
    vocab = padded_vocab_size(config)
    names = {"ln_1": "norm1", "attn.out_proj": "mixer.out_proj", "mlp.fc_in": "mlp.fc1",
             "mlp.fc_out": "mlp.fc2"}
    out, qkv = OrderedDict(), {}
    for key, value in state_dict.items():
        key = re.sub(r"^transformer\.", "", key)
        if re.search(r"attn\.(masked_)?bias$|embed_positions$", key):
            continue
        if key == "wte.weight":
            out["transformer.embeddings.word_embeddings.weight"] = pad_vocab(value, vocab)
        elif key.startswith("lm_head."):
            out[key] = pad_vocab(value, vocab)
        elif key.startswith("ln_f."):
            out["transformer." + key] = value
        else:
            i, module, param = split_layer_key(r"h\.", key, "remap_state_dict_hf_gptj")
            if module in ("attn.q_proj", "attn.k_proj", "attn.v_proj"):
                qkv[(i, module[5], param)] = value
            else:
                out[f"transformer.layers.{i}.{names[module]}.{param}"] = value
    stack_qkv(out, qkv)
    return out


register_family(ModelFamily(
    name="gptj", module=__name__, model_types=("gptj",),
    config_to_gpt2_config=gptj_config_to_gpt2_config, remap_state_dict=remap_state_dict_hf_gptj,
    matches=key_pattern(r"\.attn\.q_proj\.")))
