"""Llama as a GPT configuration: RMSNorm, SwiGLU MLP, rotary embeddings, grouped-query
attention, no biases, untied head. HF LlamaForCausalLM checkpoints and Meta's original ones
(consolidated.NN.pth + params.json) map onto GPTLMHeadModel.

Rotary layout: HF's q/k projections are ordered for the "rotate half" (non-interleaved) form, so
the config keeps rotary_emb_interleaved=False and HF weights need no permutation; Meta's rotate
interleaved pairs, so their q/k rows are reordered to the rotate-half form on the way in (the
same permutation HF's conversion script applies).
"""

import json
import re
from collections import OrderedDict
from pathlib import Path

import torch
from einops import rearrange
from transformers import GPT2Config, LlamaConfig

from flash_attn.models.checkpoint import (pad_vocab, padded_vocab_size, split_layer_key, stack_qkv,
                                          tie_lm_head)
from flash_attn.models.registry import ModelFamily, key_pattern, register_family


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


# The HF Llama layer modules that are renamed as they are (Baichuan's layout shares them).
HF_LAYER_NAMES = {
    "input_layernorm": "norm1",
    "post_attention_layernorm": "norm2",
    "self_attn.o_proj": "mixer.out_proj",
    "mlp.down_proj": "mlp.fc2",
}


def remap_state_dict_hf_llama(state_dict, config):
    """HF LlamaForCausalLM state dict -> GPTLMHeadModel(config)'s (config from
    llama_config_to_gpt2_config). q/k/v are stacked into Wqkv; [up; gate] into fc1 (the gated
    MLP reads the first half as the value and the second as the gate)."""
    return remap_llama_layout(state_dict, config, HF_LAYER_NAMES, "remap_state_dict_hf_llama")


def remap_llama_layout(state_dict, config, layer_names, caller):
    """The HF Llama key layout (model.embed_tokens, model.layers.N..., model.norm, lm_head) ->
    GPTLMHeadModel(config)'s. layer_names: the layer modules renamed as they are; q/k/v and
    gate/up projections not in it are stacked into Wqkv and fc1. caller names the errors."""
    vocab_size = padded_vocab_size(config)
    out, qkv, gated = OrderedDict(), {}, {}
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
            i, module, param = split_layer_key(r"layers\.", key, caller)
            if module in layer_names:
                out[f"transformer.layers.{i}.{layer_names[module]}.{param}"] = value
            elif module in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
                qkv[(i, module[len("self_attn.")], param)] = value
            elif module in ("mlp.up_proj", "mlp.gate_proj"):
                gated[(i, module, param)] = value
            else:
                raise KeyError(f"{caller}: unexpected key {key!r}")
    stack_qkv(out, qkv)
    for i, param in sorted({(i, p) for i, _, p in gated}):
        out[f"transformer.layers.{i}.mlp.fc1.{param}"] = torch.cat(
            [gated[(i, "mlp.up_proj", param)], gated[(i, "mlp.gate_proj", param)]], dim=0)
    return tie_lm_head(out, config)


def inv_remap_state_dict_hf_llama(state_dict, config):
    """GPTLMHeadModel(config) state dict -> HF LlamaForCausalLM's (vocabulary padding removed)."""
    head_dim = config.n_embd // config.n_head
    n_head_kv = getattr(config, "n_head_kv", None) or config.n_head
    q_dim, kv_dim = config.n_head * head_dim, n_head_kv * head_dim
    inverse = {v: k for k, v in HF_LAYER_NAMES.items()}
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


# ----------------------------------------------------------------------------------------------
# Meta's original checkpoints: <checkpoint_path>/<model_name>/{params.json, consolidated.NN.pth},
# one file per model-parallel rank (fairscale layout: wq / wk / wv / w1 / w3 / output split by
# rows, wo / w2 by columns, tok_embeddings by columns (Llama 1 / 2) or rows (Llama 3), norms
# replicated).
# ----------------------------------------------------------------------------------------------


def config_from_meta_checkpoint(checkpoint_path, model_name):
    """LlamaConfig from <checkpoint_path>/<model_name>/params.json."""
    folder = Path(checkpoint_path) / model_name
    params = json.loads((folder / "params.json").read_text())
    if params.get("use_scaled_rope"):
        raise NotImplementedError("config_from_meta_checkpoint: use_scaled_rope (Llama 3.1 rope "
                                  "scaling) is not supported")
    # Meta's FeedForward: two thirds of 4 * dim (SwiGLU has three matrices, not two), times
    # ffn_dim_multiplier, rounded up to multiple_of.
    intermediate_size = int(2 * 4 * params["dim"] / 3)
    if params.get("ffn_dim_multiplier") is not None:
        intermediate_size = int(params["ffn_dim_multiplier"] * intermediate_size)
    multiple_of = params.get("multiple_of", 1)
    intermediate_size = multiple_of * -(-intermediate_size // multiple_of)
    return LlamaConfig(
        hidden_size=params["dim"], intermediate_size=intermediate_size,
        num_attention_heads=params["n_heads"], num_hidden_layers=params["n_layers"],
        num_key_value_heads=params.get("n_kv_heads") or params["n_heads"],
        rms_norm_eps=params["norm_eps"], rope_theta=params.get("rope_theta", 10000.0),
        vocab_size=_meta_vocab_size(params, folder))


def _meta_vocab_size(params, folder):
    """params.json's vocab_size when set (Llama 1 / 2 write -1), else the tokenizer's, else
    32000 (Llama 1 / 2's vocabulary; some Code Llama models have 32016, hence the tokenizer)."""
    if params.get("vocab_size", -1) > 0:
        return params["vocab_size"]
    tokenizer = folder / "tokenizer.model"
    if not tokenizer.is_file():
        return 32000
    try:
        from sentencepiece import SentencePieceProcessor
    except ImportError as error:
        raise ImportError(f"config_from_meta_checkpoint: reading the vocabulary size from "
                          f"{tokenizer} needs the sentencepiece package") from error
    return SentencePieceProcessor(model_file=str(tokenizer)).vocab_size()


def config_from_hf_checkpoint(checkpoint_path, model_name):
    """LlamaConfig of the HF conversion beside Meta's folder: <checkpoint_path>/<model_name>-hf."""
    return LlamaConfig.from_pretrained(Path(checkpoint_path) / f"{model_name}-hf")


def config_from_checkpoint(checkpoint_path, model_name, checkpoint_format="meta"):
    if checkpoint_format not in ("meta", "hf"):
        raise ValueError(f"checkpoint_format must be 'meta' or 'hf', got {checkpoint_format!r}")
    if checkpoint_format == "meta":
        return config_from_meta_checkpoint(checkpoint_path, model_name)
    return config_from_hf_checkpoint(checkpoint_path, model_name)


def state_dicts_from_checkpoint(checkpoint_path, model_name):
    """Meta's consolidated.NN.pth state dicts, in rank order: remap each with
    remap_state_dict_meta_llama, then merge them with checkpoint.combine_state_dicts_tp."""
    paths = sorted((Path(checkpoint_path) / model_name).glob("consolidated.*.pth"),
                   key=lambda path: int(path.name.split(".")[1]))
    if not paths:
        raise FileNotFoundError(f"state_dicts_from_checkpoint: no consolidated.*.pth in "
                                f"{Path(checkpoint_path) / model_name}")
    return [torch.load(path, map_location="cpu", weights_only=True, mmap=True) for path in paths]


_META_LAYER_NAMES = {"attention_norm": "norm1", "ffn_norm": "norm2",
                     "attention.wo": "mixer.out_proj", "feed_forward.w2": "mlp.fc2"}


def _meta_vocab(value, config):
    """A whole vocabulary is padded here; a rank's rows are padded once merged."""
    if value.shape[0] < config.vocab_size:
        return value
    return pad_vocab(value, padded_vocab_size(config))


def remap_state_dict_meta_llama(state_dict, config):
    """One of Meta's Llama state dicts (the whole model, or one model-parallel rank's share)
    -> GPTLMHeadModel(config)'s (or that rank's share of it). wq / wk rows are reordered from
    Meta's interleaved rotary pairs to the rotate-half form; [w3 (up); w1 (gate)] become fc1."""
    head_dim = config.n_embd // config.n_head
    out, pieces = OrderedDict(), {}
    for key, value in state_dict.items():
        if key.endswith("rope.freqs"):  # recomputed from the config
            continue
        if key == "tok_embeddings.weight":
            out["transformer.embeddings.word_embeddings.weight"] = _meta_vocab(value, config)
        elif key == "output.weight":
            out["lm_head.weight"] = _meta_vocab(value, config)
        elif key == "norm.weight":
            out["transformer.ln_f.weight"] = value
        else:
            i, module, param = split_layer_key(r"layers\.", key, "remap_state_dict_meta_llama")
            if module in _META_LAYER_NAMES:
                out[f"transformer.layers.{i}.{_META_LAYER_NAMES[module]}.{param}"] = value
            else:  # wq / wk / wv and w1 / w3, stacked below
                pieces[(i, module)] = value
    for i in sorted({i for i, _ in pieces}, key=int):
        q, k, v = [pieces.pop((i, f"attention.w{name}")) for name in "qkv"]
        q, k = [rearrange(w, "(h d two) n -> (h two d) n", two=2, d=head_dim // 2) for w in (q, k)]
        out[f"transformer.layers.{i}.mixer.Wqkv.weight"] = torch.cat([q, k, v], dim=0)
        gate, up = pieces.pop((i, "feed_forward.w1")), pieces.pop((i, "feed_forward.w3"))
        out[f"transformer.layers.{i}.mlp.fc1.weight"] = torch.cat([up, gate], dim=0)
    if pieces:
        raise KeyError(f"remap_state_dict_meta_llama: unexpected keys {sorted(pieces)[:4]}")
    return tie_lm_head(out, config)


register_family(ModelFamily(
    name="llama", module=__name__, model_types=("llama",),
    config_to_gpt2_config=llama_config_to_gpt2_config, remap_state_dict=remap_state_dict_hf_llama,
    inv_remap_state_dict=inv_remap_state_dict_hf_llama,
    matches=key_pattern(r"\.self_attn\.q_proj\.")))
register_family(ModelFamily(
    name="meta_llama", module=__name__, model_types=(),
    remap_state_dict=remap_state_dict_meta_llama,
    matches=key_pattern(r"^layers\.\d+\.attention\.wq\.")))
