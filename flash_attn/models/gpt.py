"""GPT: token embeddings, a stack of blocks, a final norm and a language-model head.

Configured by a transformers `GPT2Config` plus flash-attn's flags (read with getattr, default in
brackets): use_flash_attn [False], fused_bias_fc [False], fused_mlp [False],
fused_dropout_add_ln [False], residual_in_fp32 [False], prenorm [True], rms_norm [False],
rotary_emb_fraction [0.0] / rotary_emb_base / rotary_emb_scale_base / rotary_emb_interleaved,
use_alibi, window_size, n_head_kv (GQA), parallel_block (GPT-J style) / parallel_block_tied_norm,
qkv_proj_bias / out_proj_bias / mlp_fc1_bias / mlp_fc2_bias [True], lm_head_bias [False],
mlp_multiple_of [128] (gated MLPs), pad_vocab_size_multiple [1], tie_word_embeddings [True],
word_embed_proj_dim, sequence_parallel [True] (with a process_group), mlp_checkpoint_lvl [0].
muP (BTLM): mup_width_scale [1.0] (init std x sqrt, lr_multiplier in each linear weight's
_optim), mup_embeddings_multiplier, mup_output_multiplier (logits x it x mup_width_scale),
mup_scale_qk_dot_by_d (softmax scale 1/d), mup_attn_multiplier. norm_head (Baichuan 2): the
lm_head rows are L2-normalised before the product.
The flags only choose which module class is built; the forward pass reads the same either way.

Checkpoints: remap_state_dict_hf_gpt2 / remap_state_dict_megatron here, the other families in
their own modules, found through flash_attn.models.registry; shared helpers and the
tensor-parallel shard / combine in flash_attn.models.checkpoint (also importable from here).
"""

import math
import re
from collections import OrderedDict, namedtuple
from functools import partial

import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

from flash_attn.models.checkpoint import (  # noqa: F401  (also importable from here)
    attention_layout,
    combine_state_dicts_tp,
    pad_vocab,
    padded_vocab_size,
    put_gpt2_top_level,
    shard_state_dict_tp,
    split_layer_key,
    stack_qkv,
    tie_lm_head,
)
from flash_attn.models.registry import (  # noqa: F401  (remap_state_dict_any: also from here)
    ModelFamily,
    key_pattern,
    register_family,
    remap_state_dict_any,
)
from flash_attn.modules.block import Block, ParallelBlock, _is_rms_norm, _norm_eps, fused_add_norm_fn
from flash_attn.modules.embedding import GPT2Embeddings, ParallelGPT2Embeddings
from flash_attn.modules.mha import MHA, ParallelMHA, warn_fallback
from flash_attn.modules.mlp import GatedMlp, Mlp, ParallelGatedMlp, ParallelMLP, fused_mlp_cls
from flash_attn.utils.generation import GenerationMixin

CausalLMOutput = namedtuple("CausalLMOutput", ["logits"])
CausalLMLoss = namedtuple("CausalLMLoss", ["loss"])

GELU_TANH = ("gelu_new", "gelu_fast", "gelu_approx", "gelu_pytorch_tanh")
GATED = {"glu": F.sigmoid, "swiglu": F.silu, "geglu": F.gelu}  # checkpoint.GATED_ACTIVATIONS


def _sqrelu(x):
    return F.relu(x).square()


# ----------------------------------------------------------------------------------------------
# Building blocks from the config.
# ----------------------------------------------------------------------------------------------


def create_mixer_cls(config, layer_idx=None, process_group=None, device=None, dtype=None):
    head_dim, _, _ = attention_layout(config)
    if head_dim * config.n_head != config.n_embd:
        raise ValueError(f"head_dim ({head_dim}) x n_head ({config.n_head}) must equal n_embd "
                         f"({config.n_embd})")
    softmax_scale = 1.0
    if getattr(config, "scale_attn_weights", True):  # by 1/sqrt(d), or muP's 1/d
        softmax_scale = head_dim ** (-1.0 if getattr(config, "mup_scale_qk_dot_by_d", False)
                                     else -0.5)
    softmax_scale *= getattr(config, "mup_attn_multiplier", 1.0)
    if getattr(config, "scale_attn_by_inverse_layer_idx", False):
        softmax_scale /= float(layer_idx + 1)
    kwargs = dict(
        num_heads=config.n_head, num_heads_kv=getattr(config, "n_head_kv", None),
        qkv_proj_bias=getattr(config, "qkv_proj_bias", True),
        out_proj_bias=getattr(config, "out_proj_bias", True),
        dropout=config.attn_pdrop, softmax_scale=softmax_scale, causal=True, layer_idx=layer_idx,
        rotary_emb_dim=int(getattr(config, "rotary_emb_fraction", 0.0) * head_dim),
        rotary_emb_base=getattr(config, "rotary_emb_base", 10000.0),
        rotary_emb_scale_base=getattr(config, "rotary_emb_scale_base", None),
        rotary_emb_interleaved=getattr(config, "rotary_emb_interleaved", False),
        use_alibi=getattr(config, "use_alibi", False),
        window_size=tuple(getattr(config, "window_size", (-1, -1))),
        use_flash_attn=getattr(config, "use_flash_attn", False), device=device, dtype=dtype)
    if process_group is None:
        return partial(MHA, fused_bias_fc=getattr(config, "fused_bias_fc", False),
                       dwconv=getattr(config, "attn_dwconv", False), **kwargs)
    return partial(ParallelMHA, process_group=process_group,
                   sequence_parallel=getattr(config, "sequence_parallel", True), **kwargs)


def create_mlp_cls(config, layer_idx=None, process_group=None, device=None, dtype=None):
    factory = {"device": device, "dtype": dtype}
    act = config.activation_function
    inner_dim = config.n_inner if config.n_inner is not None else 4 * config.n_embd
    bias = dict(bias1=getattr(config, "mlp_fc1_bias", True), bias2=getattr(config, "mlp_fc2_bias", True))
    parallel = ({} if process_group is None else
                dict(process_group=process_group,
                     sequence_parallel=getattr(config, "sequence_parallel", True)))
    if act in GATED:
        cls = GatedMlp if process_group is None else ParallelGatedMlp
        return partial(cls, hidden_features=inner_dim, activation=GATED[act],
                       multiple_of=getattr(config, "mlp_multiple_of", 128), **bias, **parallel,
                       **factory)
    if act not in GELU_TANH + ("gelu", "relu", "sqrelu"):
        raise ValueError(f"activation_function {act!r} is not supported")
    if getattr(config, "fused_mlp", False):
        fused_name = "gelu_approx" if act in GELU_TANH else act
        if act == "gelu":
            warn_fallback("fused_mlp", "FusedMLP has no exact-erf gelu")
        elif process_group is None and fused_mlp_cls() is not None:
            return partial(fused_mlp_cls(), hidden_features=inner_dim, activation=fused_name,
                           checkpoint_lvl=getattr(config, "mlp_checkpoint_lvl", 0), **bias, **factory)
        elif process_group is not None:
            from flash_attn.modules.mha import import_optional

            parallel_fused = import_optional("flash_attn.ops.fused_dense", "ParallelFusedMLP")
            if parallel_fused is not None:
                return partial(parallel_fused, hidden_features=inner_dim, activation=fused_name,
                               checkpoint_lvl=getattr(config, "mlp_checkpoint_lvl", 0), **bias,
                               **parallel, **factory)
            warn_fallback("fused_mlp", "flash_attn.ops.fused_dense.ParallelFusedMLP is unavailable")
        else:
            warn_fallback("fused_mlp", "flash_attn.ops.fused_dense.FusedMLP is unavailable")
    activation = {"gelu": F.gelu, "relu": F.relu, "sqrelu": _sqrelu}.get(
        act, partial(F.gelu, approximate="tanh"))
    cls = Mlp if process_group is None else ParallelMLP
    return partial(cls, hidden_features=inner_dim, activation=activation, **bias, **parallel, **factory)


def norm_cls_from_config(config, device=None, dtype=None):
    cls = nn.RMSNorm if getattr(config, "rms_norm", False) else nn.LayerNorm
    return partial(cls, eps=config.layer_norm_epsilon, device=device, dtype=dtype)


def create_block(config, layer_idx=None, process_group=None, device=None, dtype=None):
    mixer_cls = create_mixer_cls(config, layer_idx, process_group, device, dtype)
    mlp_cls = create_mlp_cls(config, layer_idx, process_group, device, dtype)
    # The first block's "residual dropout" is the dropout on the embeddings.
    resid_dropout1 = config.embd_pdrop if layer_idx == 0 else config.resid_pdrop
    tp = process_group is not None
    common = dict(norm_cls=norm_cls_from_config(config, device, dtype),
                  resid_dropout1=resid_dropout1, resid_dropout2=config.resid_pdrop,
                  fused_dropout_add_ln=getattr(config, "fused_dropout_add_ln", False),
                  residual_in_fp32=getattr(config, "residual_in_fp32", False),
                  sequence_parallel=tp and getattr(config, "sequence_parallel", True),
                  mark_shared_params=tp)
    if getattr(config, "parallel_block", False):
        block = ParallelBlock(config.n_embd, mixer_cls, mlp_cls,
                              tied_norm=getattr(config, "parallel_block_tied_norm", False), **common)
    else:
        block = Block(config.n_embd, mixer_cls, mlp_cls, prenorm=getattr(config, "prenorm", True),
                      **common)
    block.layer_idx = layer_idx
    return block


def _init_weights(module, n_layer, initializer_range=0.02, mup_width_scale=1.0,
                  rescale_prenorm_residual=True):
    """N(0, initializer_range) for embedding weights, x sqrt(mup_width_scale) for linear ones,
    zero biases; the projections that write into the residual stream (out_proj, fc2) get
    std / sqrt(2 n_layer) (GPT-2). With muP the linear weights carry their learning-rate
    multiplier in `_optim` (read by optimizers that group parameters by it)."""
    linear_std = initializer_range * math.sqrt(mup_width_scale)
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=linear_std)
        if mup_width_scale != 1.0:
            module.weight._optim = {**getattr(module.weight, "_optim", {}),
                                    "lr_multiplier": mup_width_scale}
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, std=initializer_range)
    if rescale_prenorm_residual:
        for name, p in module.named_parameters():
            if name in ("out_proj.weight", "fc2.weight"):
                nn.init.normal_(p, mean=0.0, std=linear_std / math.sqrt(2 * n_layer))


# ----------------------------------------------------------------------------------------------
# Models.
# ----------------------------------------------------------------------------------------------


class GPTPreTrainedModel(nn.Module):
    def __init__(self, config, *args, **kwargs):
        super().__init__()
        if not hasattr(config, "n_embd"):
            raise TypeError(f"{type(self).__name__} takes a transformers GPT2Config (use e.g. "
                            f"llama_config_to_gpt2_config to convert), got {type(config).__name__}")
        self.config = config

    @classmethod
    def from_pretrained(cls, model_name, config, *args, strict=True, device=None, dtype=None,
                        world_size=1, rank=0, **kwargs):
        """Build the model and load a local checkpoint (directory or file, HF or ours):
        remapped by the family of its config.json's model_type (else by its key names, see
        models.registry), sharded for tensor parallelism when world_size > 1."""
        from flash_attn.models.registry import checkpoint_model_type
        from flash_attn.utils.pretrained import state_dict_from_pretrained

        model = cls(config, *args, device=device, dtype=dtype, **kwargs)
        state_dict = remap_state_dict_any(state_dict_from_pretrained(model_name, device="cpu"),
                                          config, model_type=checkpoint_model_type(model_name))
        if world_size > 1:
            state_dict = shard_state_dict_tp(state_dict, config, world_size, rank)
        result = model.load_state_dict(state_dict, strict=strict)
        if device is not None or dtype is not None:
            model.to(device=device, dtype=dtype)
        if not strict:
            print(result)
        return model


class GPTModel(GPTPreTrainedModel):
    def __init__(self, config, process_group=None, device=None, dtype=None):
        super().__init__(config)
        factory = {"device": device, "dtype": dtype}
        self.process_group = process_group
        self.sequence_parallel = getattr(config, "sequence_parallel", True)
        self.prenorm = getattr(config, "prenorm", True)
        self.parallel_block = getattr(config, "parallel_block", False)
        self.residual_in_fp32 = getattr(config, "residual_in_fp32", False)
        self.embeddings_multiplier = getattr(config, "mup_embeddings_multiplier", 1.0)
        if self.parallel_block and not self.prenorm:
            raise ValueError("parallel_block needs prenorm=True")
        vocab_size = padded_vocab_size(config)
        if process_group is None:
            self.embeddings = GPT2Embeddings(
                config.n_embd, vocab_size, config.max_position_embeddings,
                word_embed_proj_dim=getattr(config, "word_embed_proj_dim", None), **factory)
        else:
            self.embeddings = ParallelGPT2Embeddings(
                config.n_embd, vocab_size, config.max_position_embeddings,
                process_group=process_group, sequence_parallel=self.sequence_parallel, **factory)
        self.layers = nn.ModuleList(
            [create_block(config, i, process_group, **factory) for i in range(config.n_layer)])
        self.layer_norm_fn = fused_add_norm_fn(getattr(config, "fused_dropout_add_ln", False))
        if self.prenorm:
            self.drop_f = nn.Dropout(config.resid_pdrop)
            self.ln_f = norm_cls_from_config(config, **factory)(config.n_embd)
            if process_group is not None:
                for p in self.ln_f.parameters():
                    p._shared_params = True
                    if self.sequence_parallel:
                        p._sequence_parallel = True
        self.apply(partial(_init_weights, n_layer=config.n_layer,
                           initializer_range=config.initializer_range,
                           mup_width_scale=getattr(config, "mup_width_scale", 1.0)))

    def allocate_inference_cache(self, batch_size, max_seqlen, dtype=None, **kwargs):
        return {i: layer.allocate_inference_cache(batch_size, max_seqlen, dtype=dtype, **kwargs)
                for i, layer in enumerate(self.layers)}

    def forward(self, input_ids, position_ids=None, inference_params=None):
        """input_ids (b, s) -> final hidden states (b, s, d); with tensor and sequence
        parallelism, this rank's (b * s / world_size, d) rows."""
        tp_rows = self.process_group is not None and self.sequence_parallel
        embed_kwargs = {"combine_batch_seqlen_dim": True} if tp_rows else {}
        hidden_states = self.embeddings(input_ids, position_ids=position_ids, **embed_kwargs)
        if self.embeddings_multiplier != 1.0:
            hidden_states = hidden_states * self.embeddings_multiplier
        mixer_kwargs = {"seqlen": input_ids.shape[1]} if tp_rows else {}
        if inference_params is not None:
            mixer_kwargs["inference_params"] = inference_params
        residual, hidden_states2 = None, None
        for layer in self.layers:
            if not self.prenorm:
                hidden_states = layer(hidden_states, mixer_kwargs=mixer_kwargs)
            elif self.parallel_block:
                hidden_states, hidden_states2, residual = layer(
                    hidden_states, hidden_states2, residual, mixer_kwargs=mixer_kwargs)
            else:
                hidden_states, residual = layer(hidden_states, residual, mixer_kwargs=mixer_kwargs)
        if self.prenorm:
            hidden_states = self._final_add_norm(hidden_states, hidden_states2, residual)
        return hidden_states

    def _final_add_norm(self, hidden_states, hidden_states2, residual):
        """ln_f(dropout(last outputs) + residual)."""
        if self.layer_norm_fn is not None:
            return self.layer_norm_fn(
                hidden_states, self.ln_f.weight, getattr(self.ln_f, "bias", None),
                residual=residual, x1=hidden_states2, eps=_norm_eps(self.ln_f, hidden_states.dtype),
                dropout_p=self.drop_f.p if self.training else 0.0, prenorm=False,
                residual_in_fp32=self.residual_in_fp32, is_rms_norm=_is_rms_norm(self.ln_f))
        dropped = self.drop_f(hidden_states)
        if hidden_states2 is not None:
            dropped = dropped + self.drop_f(hidden_states2)
        residual = dropped if residual is None else dropped + residual
        return self.ln_f(residual.to(dtype=self.ln_f.weight.dtype))

    def active_paths(self):
        """Which implementation each piece runs with (after any fallback)."""
        block = self.layers[0]
        mixer, mlp = block.mixer, block.mlp
        paths = {
            "attention": "flash" if mixer.use_flash_attn else "torch",
            "qkv/out projections": type(mixer.out_proj).__name__,
            "mlp": type(mlp).__name__,
            "dropout+add+norm": "triton fused" if block.fused_dropout_add_ln else "torch",
        }
        if mixer.rotary_emb_dim > 0:
            paths["rotary"] = mixer.rotary_path
        return paths


class GPTLMHeadModel(GPTPreTrainedModel, GenerationMixin):
    def __init__(self, config, process_group=None, device=None, dtype=None):
        super().__init__(config)
        factory = {"device": device, "dtype": dtype}
        self.process_group = process_group
        self.transformer = GPTModel(config, process_group=process_group, **factory)
        self.tie_word_embeddings = getattr(config, "tie_word_embeddings", True)
        lm_head_bias = getattr(config, "lm_head_bias", False)
        self.output_scale = (getattr(config, "mup_output_multiplier", 1.0)
                             * getattr(config, "mup_width_scale", 1.0))
        self.norm_head = getattr(config, "norm_head", False)
        if self.norm_head and process_group is not None:
            raise NotImplementedError("norm_head with a process_group (tensor parallelism) is "
                                      "not supported")
        vocab_size = padded_vocab_size(config)
        word_embed_proj_dim = getattr(config, "word_embed_proj_dim", None)
        embed_dim = config.n_embd
        self.project_out = None
        if word_embed_proj_dim is not None:
            self.project_out = nn.Linear(config.n_embd, word_embed_proj_dim, bias=False, **factory)
            embed_dim = word_embed_proj_dim
        if process_group is None:
            self.lm_head = nn.Linear(embed_dim, vocab_size, bias=lm_head_bias, **factory)
        else:
            from flash_attn.ops.fused_dense import ColumnParallelLinear

            self.lm_head = ColumnParallelLinear(
                embed_dim, vocab_size, process_group, bias=lm_head_bias,
                sequence_parallel=getattr(config, "sequence_parallel", True), **factory)
        self.apply(partial(_init_weights, n_layer=config.n_layer,
                           initializer_range=config.initializer_range,
                           mup_width_scale=getattr(config, "mup_width_scale", 1.0)))
        self.tie_weights()

    def tie_weights(self):
        if self.tie_word_embeddings:
            self.lm_head.weight = self.transformer.embeddings.word_embeddings.weight
        if self.process_group is not None:
            from flash_attn.utils.distributed import sync_shared_params

            sync_shared_params(self, self.process_group)

    def allocate_inference_cache(self, batch_size, max_seqlen, dtype=None, **kwargs):
        return self.transformer.allocate_inference_cache(batch_size, max_seqlen, dtype=dtype,
                                                         **kwargs)

    def forward(self, input_ids, position_ids=None, inference_params=None, num_last_tokens=0,
                targets=None, ignore_index=-100):
        """input_ids (b, s) -> CausalLMOutput(logits (b, s, padded vocab)); num_last_tokens > 0
        keeps only the last positions (generation). With a process_group the logits are this
        rank's vocabulary slice, except in generation (inference_params given).
        targets (b, s): the token each position predicts (not shifted here, unlike HF's labels):
        returns CausalLMLoss(loss), the mean cross-entropy over the positions whose target is not
        ignore_index, through losses.linear_cross_entropy, which never holds the full logits."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (batch, seqlen), got {tuple(input_ids.shape)}")
        batch, seqlen = input_ids.shape
        hidden_states = self.transformer(input_ids, position_ids=position_ids,
                                         inference_params=inference_params)
        if num_last_tokens > 0:
            if hidden_states.dim() != 3:
                raise ValueError("num_last_tokens needs sequence_parallel=False")
            hidden_states = hidden_states[:, -num_last_tokens:]
        if self.project_out is not None:
            hidden_states = self.project_out(hidden_states)
        if self.output_scale != 1.0:
            hidden_states = hidden_states * self.output_scale
        weight = F.normalize(self.lm_head.weight) if self.norm_head else self.lm_head.weight
        if targets is not None:
            return CausalLMLoss(self._chunked_loss(hidden_states, weight, targets, ignore_index))
        if self.norm_head:
            logits = F.linear(hidden_states, weight, self.lm_head.bias)
        else:
            logits = self.lm_head(hidden_states)
        if self.process_group is not None:
            if logits.dim() == 2:  # sequence parallel: (b * s, vocab / world) rows
                logits = rearrange(logits, "(b s) v -> b s v", b=batch)
            if inference_params is not None:
                # Sampling needs the whole vocabulary: gather the ranks' slices (dim 0) and lay
                # them side by side. Training keeps this rank's slice, for a vocab-parallel loss
                # (losses.cross_entropy.CrossEntropyLoss with process_group).
                from flash_attn.utils.distributed import all_gather_raw

                logits, _ = all_gather_raw(logits, self.process_group)
                logits = rearrange(logits, "(n b) s v -> b s (n v)", b=batch)
        return CausalLMOutput(logits=logits)


    def _chunked_loss(self, hidden_states, weight, targets, ignore_index):
        from flash_attn.losses.linear_cross_entropy import linear_cross_entropy

        if self.process_group is not None:
            raise NotImplementedError("targets: the chunked loss of a vocabulary-parallel LM head "
                                      "is not implemented; compute logits and use "
                                      "CrossEntropyLoss(process_group=...)")
        hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
        if targets.numel() != hidden.shape[0]:
            raise ValueError(f"targets must have one token per position "
                             f"({hidden.shape[0]}), got shape {tuple(targets.shape)}")
        return linear_cross_entropy(hidden, weight, targets.reshape(-1), self.lm_head.bias,
                                    ignore_index=ignore_index)

# ----------------------------------------------------------------------------------------------
# Checkpoints: HF GPT-2 and Megatron-LM GPT.
# ----------------------------------------------------------------------------------------------

_GPT2_LAYER_NAMES = {"ln_1": "norm1", "ln_2": "norm2", "attn.c_attn": "mixer.Wqkv",
                     "attn.c_proj": "mixer.out_proj", "mlp.c_fc": "mlp.fc1",
                     "mlp.c_proj": "mlp.fc2"}


def remap_state_dict_hf_gpt2(state_dict, config):
    """HF GPT2Model / GPT2LMHeadModel state dict -> GPTLMHeadModel's. HF's Conv1D stores
    weights as (in, out): transposed here. The vocabulary is padded to the config's multiple."""
    out = OrderedDict()
    for key, value in state_dict.items():
        key = re.sub(r"^transformer\.", "", key)
        if re.search(r"\.attn\.(masked_)?bias$", key):  # causal-mask buffers of old checkpoints
            continue
        if not put_gpt2_top_level(out, key, value, padded_vocab_size(config)):
            i, module, param = split_layer_key(r"h\.", key, "remap_state_dict_hf_gpt2")
            if module not in _GPT2_LAYER_NAMES:
                raise KeyError(f"remap_state_dict_hf_gpt2: unexpected key {key!r}")
            if module not in ("ln_1", "ln_2") and param == "weight":
                value = value.t().contiguous()
            out[f"transformer.layers.{i}.{_GPT2_LAYER_NAMES[module]}.{param}"] = value
    return tie_lm_head(out, config)


_MEGATRON_LAYER_NAMES = {"input_layernorm": "norm1", "post_attention_layernorm": "norm2",
                         "self_attention.dense": "mixer.out_proj", "mlp.dense_h_to_4h": "mlp.fc1",
                         "mlp.dense_4h_to_h": "mlp.fc2"}


def remap_state_dict_megatron(state_dict, config):
    """Megatron-LM GPT state dict (language_model.embedding / .encoder) -> GPTLMHeadModel's,
    with a tied head. Megatron's query_key_value rows are per head [q, k, v] (heads, 3,
    head_dim); ours [all q; all k; all v]. Megatron pads its own vocabulary: the rows are padded
    further to a multiple of pad_vocab_size_multiple, so config.vocab_size should be that of the
    checkpoint."""
    head_dim, n_head, _ = attention_layout(config)
    out = OrderedDict()
    for key, value in state_dict.items():
        key = re.sub(r"^language_model\.(encoder\.)?", "", key)
        if key.endswith("rotary_emb.inv_freq"):  # recomputed from the config
            continue
        if key == "embedding.word_embeddings.weight":
            multiple = getattr(config, "pad_vocab_size_multiple", 1)
            rows = math.ceil(value.shape[0] / multiple) * multiple
            out["transformer.embeddings.word_embeddings.weight"] = pad_vocab(value, rows)
        elif key == "embedding.position_embeddings.weight":
            out["transformer.embeddings.position_embeddings.weight"] = value
        elif key.startswith("final_layernorm."):
            out["transformer.ln_f." + key.split(".", 1)[1]] = value
        else:
            i, module, param = split_layer_key(r"layers\.", key, "remap_state_dict_megatron")
            if module == "self_attention.query_key_value":
                value = rearrange(value, "(h three d) ... -> (three h d) ...", three=3,
                                  h=n_head, d=head_dim)
                out[f"transformer.layers.{i}.mixer.Wqkv.{param}"] = value
            elif module in _MEGATRON_LAYER_NAMES:
                out[f"transformer.layers.{i}.{_MEGATRON_LAYER_NAMES[module]}.{param}"] = value
            else:
                raise KeyError(f"remap_state_dict_megatron: unexpected key {key!r}")
    out["lm_head.weight"] = out["transformer.embeddings.word_embeddings.weight"]
    return out


register_family(ModelFamily(
    name="gpt2", module=__name__, model_types=("gpt2",),
    config_to_gpt2_config=lambda gpt2_config: gpt2_config,  # already ours
    remap_state_dict=remap_state_dict_hf_gpt2,
    matches=key_pattern(r"(^|\.)h\.\d+\.attn\.c_attn\.")))
register_family(ModelFamily(
    name="megatron", module=__name__, model_types=(),
    remap_state_dict=remap_state_dict_megatron, matches=key_pattern(r"^language_model\.")))
