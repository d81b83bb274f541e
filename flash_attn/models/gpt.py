"""GPT: token embeddings, a stack of blocks, a final norm and a language-model head.

Configured by a transformers `GPT2Config` plus flash-attn's flags (read with getattr, default in
brackets): use_flash_attn [False], fused_bias_fc [False], fused_mlp [False],
fused_dropout_add_ln [False], residual_in_fp32 [False], prenorm [True], rms_norm [False],
rotary_emb_fraction [0.0] / rotary_emb_base / rotary_emb_scale_base / rotary_emb_interleaved,
use_alibi, window_size, n_head_kv (GQA), parallel_block (GPT-J style) / parallel_block_tied_norm,
qkv_proj_bias / out_proj_bias / mlp_fc1_bias / mlp_fc2_bias [True], lm_head_bias [False],
mlp_multiple_of [128] (gated MLPs), pad_vocab_size_multiple [1], tie_word_embeddings [True],
word_embed_proj_dim, sequence_parallel [True] (with a process_group), mlp_checkpoint_lvl [0].
The flags only choose which module class is built; the forward pass reads the same either way.
"""

import math
import re
from collections import OrderedDict, namedtuple
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

from flash_attn.modules.block import Block, ParallelBlock, _is_rms_norm, _norm_eps, fused_add_norm_fn
from flash_attn.modules.embedding import GPT2Embeddings, ParallelGPT2Embeddings
from flash_attn.modules.mha import MHA, ParallelMHA, warn_fallback
from flash_attn.modules.mlp import GatedMlp, Mlp, ParallelGatedMlp, ParallelMLP, fused_mlp_cls
from flash_attn.utils.generation import GenerationMixin

CausalLMOutput = namedtuple("CausalLMOutput", ["logits"])

GELU_TANH = ("gelu_new", "gelu_fast", "gelu_approx", "gelu_pytorch_tanh")
GATED = {"glu": F.sigmoid, "swiglu": F.silu, "geglu": F.gelu}


def _sqrelu(x):
    return F.relu(x).square()


def padded_vocab_size(config):
    multiple = getattr(config, "pad_vocab_size_multiple", 1)
    return math.ceil(config.vocab_size / multiple) * multiple


def _head_dim(config):
    return getattr(config, "head_dim", None) or config.n_embd // config.n_head


# ----------------------------------------------------------------------------------------------
# Building blocks from the config.
# ----------------------------------------------------------------------------------------------


def create_mixer_cls(config, layer_idx=None, process_group=None, device=None, dtype=None):
    head_dim = _head_dim(config)
    if head_dim * config.n_head != config.n_embd:
        raise ValueError(f"head_dim ({head_dim}) x n_head ({config.n_head}) must equal n_embd "
                         f"({config.n_embd})")
    softmax_scale = head_dim ** (-0.5) if getattr(config, "scale_attn_weights", True) else 1.0
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


def _init_weights(module, n_layer, initializer_range=0.02, rescale_prenorm_residual=True):
    """N(0, initializer_range) for linear and embedding weights, zero biases; the projections
    that write into the residual stream (out_proj, fc2) get std / sqrt(2 n_layer) (GPT-2)."""
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=initializer_range)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, std=initializer_range)
    if rescale_prenorm_residual:
        for name, p in module.named_parameters():
            if name in ("out_proj.weight", "fc2.weight"):
                nn.init.normal_(p, mean=0.0, std=initializer_range / math.sqrt(2 * n_layer))


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
        remapped by its key names, sharded for tensor parallelism when world_size > 1."""
        from flash_attn.utils.pretrained import state_dict_from_pretrained

        model = cls(config, *args, device=device, dtype=dtype, **kwargs)
        state_dict = remap_state_dict_any(state_dict_from_pretrained(model_name, device="cpu"),
                                          config)
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
                           initializer_range=config.initializer_range))

    def allocate_inference_cache(self, batch_size, max_seqlen, dtype=None, **kwargs):
        return {i: layer.allocate_inference_cache(batch_size, max_seqlen, dtype=dtype, **kwargs)
                for i, layer in enumerate(self.layers)}

    def forward(self, input_ids, position_ids=None, inference_params=None):
        """input_ids (b, s) -> final hidden states (b, s, d); with tensor and sequence
        parallelism, this rank's (b * s / world_size, d) rows."""
        tp_rows = self.process_group is not None and self.sequence_parallel
        embed_kwargs = {"combine_batch_seqlen_dim": True} if tp_rows else {}
        hidden_states = self.embeddings(input_ids, position_ids=position_ids, **embed_kwargs)
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
                           initializer_range=config.initializer_range))
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

    def forward(self, input_ids, position_ids=None, inference_params=None, num_last_tokens=0):
        """input_ids (b, s) -> CausalLMOutput(logits (b, s, padded vocab)); num_last_tokens > 0
        keeps only the last positions (generation). With a process_group the logits are this
        rank's vocabulary slice, except in generation (inference_params given)."""
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


# ----------------------------------------------------------------------------------------------
# Checkpoints: HF GPT-2 remap, tensor-parallel shard / combine.
# ----------------------------------------------------------------------------------------------


def pad_vocab(t, vocab_size):
    """Embedding / lm_head rows (or an lm_head bias) zero-padded to vocab_size entries."""
    pad = vocab_size - t.shape[0]
    return F.pad(t, (0, 0, 0, pad) if t.dim() == 2 else (0, pad))


def split_layer_key(prefix, key, caller):
    """(layer index, module, param) of a per-layer checkpoint key prefix<i>.<module>.<param>
    (prefix a regex); a KeyError naming caller for any other key."""
    m = re.match(prefix + r"(\d+)\.(.+)\.(weight|bias)$", key)
    if m is None:
        raise KeyError(f"{caller}: unexpected key {key!r}")
    return m.groups()


def stack_qkv(out, qkv):
    """Separate q / k / v projections, qkv {(layer, "q" | "k" | "v", param): tensor}, stacked
    into out's transformer.layers.<layer>.mixer.Wqkv.<param> as [q; k; v]."""
    for i, param in sorted({(i, p) for i, _, p in qkv}):
        out[f"transformer.layers.{i}.mixer.Wqkv.{param}"] = torch.cat(
            [qkv[(i, name, param)] for name in "qkv"])


def remap_state_dict_hf_gpt2(state_dict, config):
    """HF GPT2Model / GPT2LMHeadModel state dict -> GPTLMHeadModel's. HF's Conv1D stores
    weights as (in, out): transposed here. The vocabulary is padded to the config's multiple."""
    out = OrderedDict()
    for key, value in state_dict.items():
        key = re.sub(r"^transformer\.", "", key)
        if re.search(r"\.attn\.(masked_)?bias$", key):  # causal-mask buffers of old checkpoints
            continue
        if key == "wte.weight":
            out["transformer.embeddings.word_embeddings.weight"] = pad_vocab(
                value, padded_vocab_size(config))
        elif key == "wpe.weight":
            out["transformer.embeddings.position_embeddings.weight"] = value
        elif key.startswith("ln_f."):
            out["transformer." + key] = value
        elif key == "lm_head.weight":
            out[key] = pad_vocab(value, padded_vocab_size(config))
        else:
            i, module, param = split_layer_key(r"h\.", key, "remap_state_dict_hf_gpt2")
            names = {"ln_1": "norm1", "ln_2": "norm2", "attn.c_attn": "mixer.Wqkv",
                     "attn.c_proj": "mixer.out_proj", "mlp.c_fc": "mlp.fc1", "mlp.c_proj": "mlp.fc2"}
            if module not in names:
                raise KeyError(f"remap_state_dict_hf_gpt2: unexpected key {key!r}")
            if module not in ("ln_1", "ln_2") and param == "weight":
                value = value.t().contiguous()
            out[f"transformer.layers.{i}.{names[module]}.{param}"] = value
    if getattr(config, "tie_word_embeddings", True) or "lm_head.weight" not in out:
        out["lm_head.weight"] = out["transformer.embeddings.word_embeddings.weight"]
    return out


def remap_state_dict_any(state_dict, config):
    """Pick the remap by the checkpoint's key names: ours, or HF GPT-2 / Llama / GPT-NeoX /
    GPT-J / OPT."""
    keys = list(state_dict)

    def has(fragment):
        return any(fragment in k for k in keys)

    if any(k.startswith("transformer.layers.") for k in keys):
        return state_dict
    if has(".attn.c_attn."):
        return remap_state_dict_hf_gpt2(state_dict, config)
    if has("decoder.layers."):
        from flash_attn.models.opt import remap_state_dict_hf_opt

        return remap_state_dict_hf_opt(state_dict, config)
    if has(".self_attn.q_proj."):
        from flash_attn.models.llama import remap_state_dict_hf_llama

        return remap_state_dict_hf_llama(state_dict, config)
    if has(".attention.query_key_value."):
        from flash_attn.models.gpt_neox import remap_state_dict_hf_gpt_neox

        return remap_state_dict_hf_gpt_neox(state_dict, config)
    if has(".attn.q_proj."):
        from flash_attn.models.gptj import remap_state_dict_hf_gptj

        return remap_state_dict_hf_gptj(state_dict, config)
    raise ValueError("unrecognised checkpoint layout (first keys: " + ", ".join(keys[:3]) + ")")


def _layout(config):
    head_dim = _head_dim(config)
    n_head_kv = getattr(config, "n_head_kv", None) or config.n_head
    return head_dim, config.n_head, n_head_kv


def _rank_range(total, world_size, rank, multiple_of=1):
    """[start, stop) of this rank's share, split as utils.distributed.get_dim_for_local_rank does."""
    from flash_attn.utils.distributed import get_dim_for_local_rank

    sizes = [get_dim_for_local_rank(total, world_size, r, multiple_of) for r in range(world_size)]
    if sum(sizes) != total:
        raise ValueError(f"cannot split {total} over {world_size} ranks in multiples of {multiple_of}")
    start = sum(sizes[:rank])
    return start, start + sizes[rank]


def _qkv_parts(config):
    head_dim, n_head, n_head_kv = _layout(config)
    return [n_head * head_dim, n_head_kv * head_dim, n_head_kv * head_dim], head_dim, n_head, n_head_kv


def _gated(config):
    return config.activation_function in GATED


def _fc1_parts(config):
    return 2 if _gated(config) else 1


def shard_state_dict_tp(state_dict, config, world_size, rank):
    """The full state dict -> rank's shard for GPTLMHeadModel(config, process_group) with
    world_size ranks. Row-parallel biases (out_proj, fc2) live on rank 0 only."""
    parts, head_dim, n_head, n_head_kv = _qkv_parts(config)
    if padded_vocab_size(config) % world_size != 0:
        raise ValueError("the padded vocabulary must be divisible by world_size "
                         "(set pad_vocab_size_multiple)")
    vocab_range = _rank_range(padded_vocab_size(config), world_size, rank)
    head_range = _rank_range(n_head, world_size, rank)
    kv_range = _rank_range(n_head_kv, world_size, rank)
    embed_range = _rank_range(config.n_embd, world_size, rank)

    def split_qkv(x):
        q, k, v = x.split(parts, dim=0)
        return torch.cat([q[head_range[0] * head_dim: head_range[1] * head_dim],
                          k[kv_range[0] * head_dim: kv_range[1] * head_dim],
                          v[kv_range[0] * head_dim: kv_range[1] * head_dim]], dim=0)

    def split_fc1(x):  # gated MLPs: [value; gate], each split the same way
        chunks = x.chunk(_fc1_parts(config), dim=0)
        start, stop = _rank_range(chunks[0].shape[0], world_size, rank, _mlp_multiple(config))
        return torch.cat([c[start:stop] for c in chunks], dim=0)

    out = OrderedDict()
    for key, value in state_dict.items():
        if key in ("transformer.embeddings.word_embeddings.weight", "lm_head.weight", "lm_head.bias"):
            value = value[vocab_range[0]: vocab_range[1]]
        elif key == "transformer.embeddings.position_embeddings.weight":
            value = value[:, embed_range[0]: embed_range[1]]
        elif key.endswith("mixer.Wqkv.weight") or key.endswith("mixer.Wqkv.bias"):
            value = split_qkv(value)
        elif key.endswith("mixer.out_proj.weight"):
            value = value[:, head_range[0] * head_dim: head_range[1] * head_dim]
        elif key.endswith("mlp.fc1.weight") or key.endswith("mlp.fc1.bias"):
            value = split_fc1(value)
        elif key.endswith("mlp.fc2.weight"):
            start, stop = _rank_range(value.shape[1], world_size, rank, _mlp_multiple(config))
            value = value[:, start:stop]
        elif key.endswith("mixer.out_proj.bias") or key.endswith("mlp.fc2.bias"):
            if rank != 0:
                continue
        out[key] = value.contiguous()
    return out


def _mlp_multiple(config):
    return getattr(config, "mlp_multiple_of", 128) if _gated(config) else 1


def combine_state_dicts_tp(state_dicts, config):
    """The inverse of shard_state_dict_tp: the ranks' state dicts (in rank order) -> one."""
    world_size = len(state_dicts)
    parts, head_dim, n_head, n_head_kv = _qkv_parts(config)
    local_heads = [_rank_range(n_head, world_size, r) for r in range(world_size)]
    local_kv = [_rank_range(n_head_kv, world_size, r) for r in range(world_size)]

    def join_qkv(shards):
        qs, ks, vs = [], [], []
        for shard, (h0, h1), (k0, k1) in zip(shards, local_heads, local_kv):
            q, k, v = shard.split([(h1 - h0) * head_dim, (k1 - k0) * head_dim,
                                   (k1 - k0) * head_dim], dim=0)
            qs.append(q), ks.append(k), vs.append(v)
        return torch.cat(qs + ks + vs, dim=0)

    def join_fc1(shards):
        n = _fc1_parts(config)
        chunks = [s.chunk(n, dim=0) for s in shards]
        return torch.cat([c[i] for i in range(n) for c in chunks], dim=0)

    out = OrderedDict()
    for key, value in state_dicts[0].items():
        shards = [sd[key] for sd in state_dicts if key in sd]  # row-parallel biases: rank 0
        if key in ("transformer.embeddings.word_embeddings.weight", "lm_head.weight", "lm_head.bias"):
            value = torch.cat(shards, dim=0)
        elif key == "transformer.embeddings.position_embeddings.weight":
            value = torch.cat(shards, dim=1)
        elif key.endswith("mixer.Wqkv.weight") or key.endswith("mixer.Wqkv.bias"):
            value = join_qkv(shards)
        elif key.endswith("mixer.out_proj.weight") or key.endswith("mlp.fc2.weight"):
            value = torch.cat(shards, dim=1)
        elif key.endswith("mlp.fc1.weight") or key.endswith("mlp.fc1.bias"):
            value = join_fc1(shards)
        out[key] = value
    return out
