"""BERT: embeddings + LayerNorm, post-norm encoder blocks, pooler, pre-training heads.

Configured by a transformers `BertConfig` plus flags: use_flash_attn, fused_bias_fc, fused_mlp,
fused_dropout_add_ln, pad_vocab_size_multiple, dense_seq_output (MLM logits only at the masked
positions), unpad [= use_flash_attn] (run the encoder on the packed real tokens: padding is
removed once with flash_attn.bert_padding.unpad_input and restored at the end, and attention
gets cu_seqlens instead of a mask).

Labels follow flash-attn's BERT: MLM labels are 0 where no prediction is wanted (HF uses -100).
"""

import re
from collections import OrderedDict
from dataclasses import dataclass
from functools import partial
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

from flash_attn.modules.block import Block, fused_add_norm_fn
from flash_attn.modules.embedding import BertEmbeddings
from flash_attn.modules.mha import MHA, dense_classes, warn_fallback
from flash_attn.modules.mlp import Mlp, fused_mlp_cls

GELU_TANH = ("gelu_new", "gelu_fast", "gelu_pytorch_tanh")


@dataclass
class BertModelOutput:
    last_hidden_state: torch.Tensor
    pooler_output: Optional[torch.Tensor] = None

    def __iter__(self):
        return iter((self.last_hidden_state, self.pooler_output))


@dataclass
class BertForPreTrainingOutput:
    loss: Optional[torch.Tensor]
    prediction_logits: torch.Tensor
    seq_relationship_logits: torch.Tensor


def _padded_vocab(config):
    multiple = getattr(config, "pad_vocab_size_multiple", 1)
    return (config.vocab_size + multiple - 1) // multiple * multiple


def _activation(config):
    if config.hidden_act not in ("gelu",) + GELU_TANH:
        raise ValueError(f"hidden_act {config.hidden_act!r} is not supported")
    return F.gelu if config.hidden_act == "gelu" else partial(F.gelu, approximate="tanh")


def create_mixer_cls(config, cross_attn=False, return_residual=False):
    """The encoder's attention: bidirectional MHA; cross_attn for a last layer that computes
    only a subset of the tokens (queries) against all of them (keys)."""
    rotary = {}
    if getattr(config, "position_embedding_type", "absolute") == "rotary":
        rotary = dict(rotary_emb_dim=getattr(config, "rotary_emb_dim", config.hidden_size),
                      rotary_emb_base=getattr(config, "rotary_emb_base", 10000.0),
                      rotary_emb_scale_base=getattr(config, "rotary_emb_scale_base", None),
                      rotary_emb_interleaved=getattr(config, "rotary_emb_interleaved", False))
    return partial(MHA, num_heads=config.num_attention_heads, cross_attn=cross_attn,
                   dropout=config.attention_probs_dropout_prob, causal=False,
                   fused_bias_fc=getattr(config, "fused_bias_fc", False),
                   use_flash_attn=getattr(config, "use_flash_attn", False),
                   return_residual=return_residual, **rotary)


def create_mlp_cls(config, layer_idx=None, return_residual=False):
    """The encoder's MLP: FusedMLP with fused_mlp (tanh gelu only; otherwise, or when the
    extension is missing, a warning and the plain Mlp)."""
    if getattr(config, "fused_mlp", False):
        if config.hidden_act not in GELU_TANH:
            warn_fallback("fused_mlp", "FusedMLP only has the tanh gelu")
        elif fused_mlp_cls() is None:
            warn_fallback("fused_mlp", "flash_attn.ops.fused_dense.FusedMLP is unavailable")
        else:
            checkpoint_lvl = getattr(config, "mlp_checkpoint_lvl", 0)
            if isinstance(checkpoint_lvl, (list, tuple)):  # one level per layer
                checkpoint_lvl = checkpoint_lvl[layer_idx]
            return partial(fused_mlp_cls(), hidden_features=config.intermediate_size,
                           activation="gelu_approx", checkpoint_lvl=checkpoint_lvl,
                           return_residual=return_residual)
    return partial(Mlp, hidden_features=config.intermediate_size, activation=_activation(config),
                   return_residual=return_residual)


def create_block(config, layer_idx=None):
    # With last_layer_subset the last layer only computes a subset of tokens (the masked ones
    # and CLS): a cross-attention from those to all tokens.
    cross_attn = (getattr(config, "last_layer_subset", False)
                  and layer_idx == config.num_hidden_layers - 1)
    return Block(config.hidden_size, create_mixer_cls(config, cross_attn),
                 create_mlp_cls(config, layer_idx),
                 norm_cls=partial(nn.LayerNorm, eps=config.layer_norm_eps), prenorm=False,
                 resid_dropout1=config.hidden_dropout_prob,
                 resid_dropout2=config.hidden_dropout_prob,
                 fused_dropout_add_ln=getattr(config, "fused_dropout_add_ln", False))


def _init_weights(module, initializer_range=0.02):
    """N(0, initializer_range) for linear and embedding weights (the padding row zero), zero
    biases (HF BERT's init)."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=initializer_range)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)
    if isinstance(module, nn.Embedding) and module.padding_idx is not None:
        nn.init.zeros_(module.weight[module.padding_idx])


class BertEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.unpad = getattr(config, "unpad", getattr(config, "use_flash_attn", False))
        self.layers = nn.ModuleList([create_block(config, i)
                                     for i in range(config.num_hidden_layers)])

    def forward(self, hidden_states, key_padding_mask=None, subset_mask=None):
        """hidden_states (b, s, d); key_padding_mask (b, s) bool, True = real token.
        -> (b, s, d), or with subset_mask (b, s) the (n, d) rows of hidden_states[subset_mask]
        (row-major order), the last layer computing only those."""
        if key_padding_mask is None or not self.unpad:
            mixer_kwargs = None if key_padding_mask is None else {"key_padding_mask": key_padding_mask}
            for layer in self.layers:
                hidden_states = layer(hidden_states, mixer_kwargs=mixer_kwargs)
            return hidden_states if subset_mask is None else hidden_states[subset_mask]
        from flash_attn.bert_padding import pad_input, unpad_input

        batch, seqlen = hidden_states.shape[:2]
        hidden_states, indices, cu_seqlens, max_seqlen, _ = unpad_input(hidden_states,
                                                                        key_padding_mask)
        mixer_kwargs = {"cu_seqlens": cu_seqlens, "max_seqlen": max_seqlen}
        if subset_mask is None:
            for layer in self.layers:
                hidden_states = layer(hidden_states, mixer_kwargs=mixer_kwargs)
            return pad_input(hidden_states, indices, batch, seqlen)
        for layer in self.layers[:-1]:
            hidden_states = layer(hidden_states, mixer_kwargs=mixer_kwargs)
        # Queries: the subset's rows of the packed tokens; keys: all of them.
        subset_rows = torch.nonzero(subset_mask[key_padding_mask], as_tuple=False).flatten()
        subset_seqlens = (subset_mask & key_padding_mask).sum(dim=-1, dtype=torch.int32)
        subset_cu_seqlens = F.pad(torch.cumsum(subset_seqlens, 0, dtype=torch.int32), (1, 0))
        mixer_kwargs = {"x_kv": hidden_states, "cu_seqlens": subset_cu_seqlens,
                        "max_seqlen": max_seqlen, "cu_seqlens_k": cu_seqlens,
                        "max_seqlen_k": max_seqlen}
        return self.layers[-1](hidden_states[subset_rows], mixer_kwargs=mixer_kwargs)


class BertPooler(nn.Module):
    def __init__(self, config):
        super().__init__()
        linear_cls, _ = dense_classes(getattr(config, "fused_bias_fc", False))
        self.dense = linear_cls(config.hidden_size, config.hidden_size)
        self.activation = nn.Tanh()

    def forward(self, hidden_states, pool=True):
        return self.activation(self.dense(hidden_states[:, 0] if pool else hidden_states))


class BertPredictionHeadTransform(nn.Module):
    def __init__(self, config):
        super().__init__()
        linear_cls, _ = dense_classes(getattr(config, "fused_bias_fc", False))
        self.dense = linear_cls(config.hidden_size, config.hidden_size)
        self.transform_act_fn = _activation(config)
        self.layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states):
        return self.layer_norm(self.transform_act_fn(self.dense(hidden_states)))


class BertLMPredictionHead(nn.Module):
    def __init__(self, config):
        super().__init__()
        linear_cls, _ = dense_classes(getattr(config, "fused_bias_fc", False))
        self.transform = BertPredictionHeadTransform(config)
        self.decoder = linear_cls(config.hidden_size, _padded_vocab(config), bias=True)

    def forward(self, hidden_states):
        return self.decoder(self.transform(hidden_states))


class BertPreTrainingHeads(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.predictions = BertLMPredictionHead(config)
        self.seq_relationship = nn.Linear(config.hidden_size, 2)

    def forward(self, sequence_output, pooled_output):
        return self.predictions(sequence_output), self.seq_relationship(pooled_output)


class BertPreTrainedModel(nn.Module):
    def __init__(self, config, *inputs, **kwargs):
        super().__init__()
        if not hasattr(config, "type_vocab_size"):
            raise TypeError(f"{type(self).__name__} takes a transformers BertConfig, got "
                            f"{type(config).__name__}")
        self.config = config

    @classmethod
    def from_pretrained(cls, model_name, config, *inputs, **kwargs):
        """Build the model and load a local HF BERT (or our own) checkpoint."""
        from flash_attn.utils.pretrained import state_dict_from_pretrained

        model = cls(config, *inputs, **kwargs)
        state_dict = state_dict_from_pretrained(model_name)
        if not any(k.startswith("bert.encoder.layers.") or k.startswith("encoder.layers.")
                   for k in state_dict):
            state_dict = remap_state_dict(state_dict, config)
        if not isinstance(model, BertForPreTraining):  # BertModel: no "bert." prefix, no heads
            state_dict = OrderedDict((k[len("bert."):], v) for k, v in state_dict.items()
                                     if k.startswith("bert."))
        model.load_state_dict(state_dict, strict=False)
        return model


class BertModel(BertPreTrainedModel):
    def __init__(self, config, add_pooling_layer=True):
        super().__init__(config)
        if getattr(config, "position_embedding_type", "absolute") != "absolute":
            raise ValueError("only absolute position embeddings are supported")
        self.layer_norm_fn = fused_add_norm_fn(getattr(config, "fused_dropout_add_ln", False))
        self.embeddings = BertEmbeddings(config.hidden_size, _padded_vocab(config),
                                         config.max_position_embeddings, config.type_vocab_size,
                                         padding_idx=config.pad_token_id)
        self.emb_drop = nn.Dropout(config.hidden_dropout_prob)
        self.emb_ln = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.encoder = BertEncoder(config)
        self.pooler = BertPooler(config) if add_pooling_layer else None
        self.apply(partial(_init_weights, initializer_range=config.initializer_range))

    def forward(self, input_ids, position_ids=None, token_type_ids=None, attention_mask=None,
                masked_tokens_mask=None):
        """-> BertModelOutput(last_hidden_state (b, s, d), pooler_output (b, d) or None).
        Rows of padding positions are zeros on the unpadded path. With masked_tokens_mask
        (b, s) (and last_layer_subset) last_hidden_state is only those tokens' rows (n, d)."""
        hidden_states = self.embeddings(input_ids, position_ids=position_ids,
                                        token_type_ids=token_type_ids)
        if self.layer_norm_fn is not None:
            hidden_states = self.layer_norm_fn(hidden_states, self.emb_ln.weight,
                                               self.emb_ln.bias, eps=self.emb_ln.eps)
        else:
            hidden_states = self.emb_ln(hidden_states)
        hidden_states = self.emb_drop(hidden_states)
        key_padding_mask = attention_mask.bool() if attention_mask is not None else None
        if masked_tokens_mask is None:
            sequence_output = self.encoder(hidden_states, key_padding_mask=key_padding_mask)
            pooled_output = self.pooler(sequence_output) if self.pooler is not None else None
            return BertModelOutput(last_hidden_state=sequence_output, pooler_output=pooled_output)
        # The last layer computes the masked tokens and the first (CLS, for the pooler) only.
        first_col = torch.zeros_like(masked_tokens_mask)
        first_col[:, 0] = True
        subset_mask = masked_tokens_mask | first_col
        subset_output = self.encoder(hidden_states, key_padding_mask=key_padding_mask,
                                     subset_mask=subset_mask)
        pooled_output = None
        if self.pooler is not None:
            pooled_output = self.pooler(subset_output[first_col[subset_mask]], pool=False)
        return BertModelOutput(last_hidden_state=subset_output[masked_tokens_mask[subset_mask]],
                               pooler_output=pooled_output)


class BertForPreTraining(BertPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.dense_seq_output = getattr(config, "dense_seq_output", False)
        self.last_layer_subset = getattr(config, "last_layer_subset", False)
        if self.last_layer_subset and not self.dense_seq_output:
            raise ValueError("last_layer_subset needs dense_seq_output")
        self.bert = BertModel(config)
        self.cls = BertPreTrainingHeads(config)
        self.mlm_loss = nn.CrossEntropyLoss(ignore_index=0)
        self.nsp_loss = nn.CrossEntropyLoss(ignore_index=-1)
        self.apply(partial(_init_weights, initializer_range=config.initializer_range))
        self.tie_weights()

    def tie_weights(self):
        self.cls.predictions.decoder.weight = self.bert.embeddings.word_embeddings.weight

    def forward(self, input_ids, position_ids=None, token_type_ids=None, attention_mask=None,
                labels=None, next_sentence_label=None):
        """labels (b, s): token ids to predict, 0 elsewhere; next_sentence_label (b,)."""
        subset = self.last_layer_subset and labels is not None
        sequence_output, pooled_output = self.bert(
            input_ids, position_ids=position_ids, token_type_ids=token_type_ids,
            attention_mask=attention_mask, masked_tokens_mask=labels > 0 if subset else None)
        masked = None
        if self.dense_seq_output and labels is not None:
            masked = torch.nonzero(labels.flatten() > 0, as_tuple=False).flatten()
            if not subset:  # otherwise the encoder already returned just these rows
                sequence_output = rearrange(sequence_output, "b s d -> (b s) d")[masked]
        prediction_scores, seq_relationship_score = self.cls(sequence_output, pooled_output)
        loss = None
        if labels is not None and next_sentence_label is not None:
            mlm_labels = labels.flatten() if masked is None else labels.flatten()[masked]
            mlm = self.mlm_loss(prediction_scores.reshape(-1, prediction_scores.shape[-1]).float(),
                                mlm_labels)
            nsp = self.nsp_loss(seq_relationship_score.float(), next_sentence_label.flatten())
            loss = mlm + nsp
        return BertForPreTrainingOutput(loss=loss, prediction_logits=prediction_scores,
                                        seq_relationship_logits=seq_relationship_score)


# ----------------------------------------------------------------------------------------------
# HF checkpoints.
# ----------------------------------------------------------------------------------------------

_RENAMES = [  # (HF pattern, ours), applied in order
    (r"^bert\.embeddings\.LayerNorm\.", "bert.emb_ln."),
    (r"^bert\.encoder\.layer\.(\d+)\.attention\.output\.LayerNorm\.", r"bert.encoder.layers.\1.norm1."),
    (r"^bert\.encoder\.layer\.(\d+)\.output\.LayerNorm\.", r"bert.encoder.layers.\1.norm2."),
    (r"^bert\.encoder\.layer\.(\d+)\.attention\.output\.dense\.", r"bert.encoder.layers.\1.mixer.out_proj."),
    (r"^bert\.encoder\.layer\.(\d+)\.intermediate\.dense\.", r"bert.encoder.layers.\1.mlp.fc1."),
    (r"^bert\.encoder\.layer\.(\d+)\.output\.dense\.", r"bert.encoder.layers.\1.mlp.fc2."),
    (r"^cls\.predictions\.transform\.LayerNorm\.", "cls.predictions.transform.layer_norm."),
]


def _with_prefix(state_dict):
    """HF BertModel checkpoints have no "bert." prefix; BertForPreTraining ones do."""
    prefixed = any(k.startswith("bert.") for k in state_dict)
    if prefixed:
        return state_dict, True
    return OrderedDict(("bert." + k, v) for k, v in state_dict.items()), False


def remap_state_dict(state_dict, config):
    """HF BertForPreTraining (or BertModel) state dict -> ours: q/k/v stacked into Wqkv,
    LayerNorm gamma/beta renamed, vocabulary padded (decoder bias padded with -100 so padded
    tokens never win)."""
    state_dict, prefixed = _with_prefix(state_dict)
    out, qkv = OrderedDict(), {}
    for key, value in state_dict.items():
        if key.endswith("position_ids"):  # a buffer in some checkpoints
            continue
        key = re.sub(r"LayerNorm\.gamma$", "LayerNorm.weight", key)
        key = re.sub(r"LayerNorm\.beta$", "LayerNorm.bias", key)
        m = re.match(r"^bert\.encoder\.layer\.(\d+)\.attention\.self\.(query|key|value)\.(weight|bias)$", key)
        if m:
            qkv[m.groups()] = value
            continue
        for pattern, repl in _RENAMES:
            key = re.sub(pattern, repl, key)
        out[key] = value
    last = config.num_hidden_layers - 1
    for i in range(config.num_hidden_layers):
        for param in ("weight", "bias"):
            q, k, v = [qkv.pop((str(i), name, param)) for name in ("query", "key", "value")]
            prefix = f"bert.encoder.layers.{i}.mixer"
            if i == last and getattr(config, "last_layer_subset", False):  # cross-attention
                out[f"{prefix}.Wq.{param}"] = q
                out[f"{prefix}.Wkv.{param}"] = torch.cat([k, v], dim=0)
            else:
                out[f"{prefix}.Wqkv.{param}"] = torch.cat([q, k, v], dim=0)
    if qkv:
        raise KeyError(f"remap_state_dict: unexpected attention keys {sorted(qkv)[:4]}")

    vocab = _padded_vocab(config)
    word = "bert.embeddings.word_embeddings.weight"
    out[word] = F.pad(out[word], (0, 0, 0, vocab - out[word].shape[0]))
    if "cls.predictions.bias" in out:  # HF ties it to the decoder's bias
        bias = out.pop("cls.predictions.bias")
        out.setdefault("cls.predictions.decoder.bias", bias)
    if "cls.predictions.decoder.bias" in out:
        bias = out["cls.predictions.decoder.bias"]
        out["cls.predictions.decoder.bias"] = F.pad(bias, (0, vocab - bias.shape[0]), value=-100.0)
        out["cls.predictions.decoder.weight"] = out[word]
    if not prefixed:
        out = OrderedDict((k[len("bert."):], v) for k, v in out.items())
    return out


def inv_remap_state_dict(state_dict, config):
    """Ours -> HF BertForPreTraining's (or BertModel's, without the "bert." prefix)."""
    state_dict, prefixed = _with_prefix(state_dict)
    renames = [  # _RENAMES inverted
        (r"^bert\.emb_ln\.", "bert.embeddings.LayerNorm."),
        (r"^bert\.encoder\.layers\.(\d+)\.norm1\.", r"bert.encoder.layer.\1.attention.output.LayerNorm."),
        (r"^bert\.encoder\.layers\.(\d+)\.norm2\.", r"bert.encoder.layer.\1.output.LayerNorm."),
        (r"^bert\.encoder\.layers\.(\d+)\.mixer\.out_proj\.", r"bert.encoder.layer.\1.attention.output.dense."),
        (r"^bert\.encoder\.layers\.(\d+)\.mlp\.fc1\.", r"bert.encoder.layer.\1.intermediate.dense."),
        (r"^bert\.encoder\.layers\.(\d+)\.mlp\.fc2\.", r"bert.encoder.layer.\1.output.dense."),
        (r"^cls\.predictions\.transform\.layer_norm\.", "cls.predictions.transform.LayerNorm."),
    ]
    out = OrderedDict()
    for key, value in state_dict.items():
        m = re.match(r"^bert\.encoder\.layers\.(\d+)\.mixer\.(Wqkv|Wq|Wkv)\.(weight|bias)$", key)
        if m:
            i, module, param = m.groups()
            names = {"Wqkv": ("query", "key", "value"), "Wq": ("query",), "Wkv": ("key", "value")}
            for name, part in zip(names[module], value.chunk(len(names[module]), dim=0)):
                out[f"bert.encoder.layer.{i}.attention.self.{name}.{param}"] = part
            continue
        for pattern, repl in renames:
            key = re.sub(pattern, repl, key)
        if key in ("bert.embeddings.word_embeddings.weight", "cls.predictions.decoder.weight",
                   "cls.predictions.decoder.bias"):
            value = value[: config.vocab_size]
        out[key] = value
    if "cls.predictions.decoder.bias" in out:
        out["cls.predictions.bias"] = out["cls.predictions.decoder.bias"]
    if not prefixed:
        out = OrderedDict((k[len("bert."):], v) for k, v in out.items())
    return out
