"""Baichuan / Baichuan 2 (remote-code checkpoints, model_type "baichuan") as a GPT
configuration: Llama's block (RMSNorm, SwiGLU, no biases, untied head) with q / k / v in one
W_pack projection ([q; k; v] rows, our Wqkv as is). The 7B models use rotary embeddings
(rotate-half), the 13B ones ALiBi; Baichuan 2 normalises the lm_head rows (NormHead).

The published configs say neither which position encoding nor whether the head is normalised,
so by default these follow the model sizes that were released (flash-attn's rule): ALiBi for
hidden_size >= 5000 (13B: 5120, 7B: 4096), NormHead for vocab_size > 70000 (Baichuan 2: 125696,
Baichuan 1: 64000). use_alibi / norm_head override them.
"""

from transformers import GPT2Config

from flash_attn.models.llama import HF_LAYER_NAMES, remap_llama_layout
from flash_attn.models.registry import ModelFamily, key_pattern, register_family


def baichuan_config_to_gpt2_config(baichuan_config, use_alibi=None, norm_head=None):
    if getattr(baichuan_config, "hidden_act", "silu") != "silu":
        raise NotImplementedError(f"baichuan_config_to_gpt2_config: hidden_act "
                                  f"{baichuan_config.hidden_act!r} is not supported")
    if use_alibi is None:
        use_alibi = baichuan_config.hidden_size >= 5000
    if norm_head is None:
        norm_head = baichuan_config.vocab_size > 70000
    return GPT2Config(
        vocab_size=baichuan_config.vocab_size,
        n_positions=0,  # rotary or ALiBi
        n_embd=baichuan_config.hidden_size,
        n_layer=baichuan_config.num_hidden_layers,
        n_head=baichuan_config.num_attention_heads,
        n_inner=baichuan_config.intermediate_size,
        activation_function="swiglu",
        mlp_multiple_of=1,  # intermediate_size is used as given
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        layer_norm_epsilon=baichuan_config.rms_norm_eps,
        initializer_range=getattr(baichuan_config, "initializer_range", 0.02),
        bos_token_id=getattr(baichuan_config, "bos_token_id", None),
        eos_token_id=getattr(baichuan_config, "eos_token_id", None),
        pad_token_id=getattr(baichuan_config, "pad_token_id", None),
        rms_norm=True,
        rotary_emb_fraction=0.0 if use_alibi else 1.0,
        rotary_emb_interleaved=False,
        use_alibi=use_alibi,
        norm_head=norm_head,
        tie_word_embeddings=getattr(baichuan_config, "tie_word_embeddings", False),
        qkv_proj_bias=False, out_proj_bias=False, mlp_fc1_bias=False, mlp_fc2_bias=False,
    )


def remap_state_dict_hf_baichuan(state_dict, config):
    """Baichuan's (remote-code BaichuanForCausalLM) state dict -> GPTLMHeadModel(config)'s:
    Llama's key layout with W_pack ([q; k; v]) as our Wqkv."""
    names = dict(HF_LAYER_NAMES, **{"self_attn.W_pack": "mixer.Wqkv"})
    return remap_llama_layout(state_dict, config, names, "remap_state_dict_hf_baichuan")


register_family(ModelFamily(
    name="baichuan", module=__name__, model_types=("baichuan",),
    config_to_gpt2_config=baichuan_config_to_gpt2_config,
    remap_state_dict=remap_state_dict_hf_baichuan,
    matches=key_pattern(r"\.self_attn\.W_pack\.")))
