"""State-dict helpers shared by the checkpoint remaps (one module per model family) and the
tensor-parallel shard / combine of GPTLMHeadModel's state dict.

Our layout: transformer.embeddings.{word_embeddings, position_embeddings}, per layer
transformer.layers.<i>.{norm1, norm2, mixer.Wqkv, mixer.out_proj, mlp.fc1, mlp.fc2},
transformer.ln_f, lm_head. Wqkv's rows are [all q heads; all k heads; all v heads]; a gated MLP's
fc1 rows are [value; gate]. The vocabulary is padded to the config's pad_vocab_size_multiple.
"""

import math
import re
from collections import OrderedDict

import torch
import torch.nn.functional as F

# The activations whose MLP is gated (gpt.GATED holds their functions): fc1 is [value; gate].
GATED_ACTIVATIONS = ("glu", "swiglu", "geglu")

VOCAB_KEYS = ("transformer.embeddings.word_embeddings.weight", "lm_head.weight", "lm_head.bias")


def padded_vocab_size(config):
    multiple = getattr(config, "pad_vocab_size_multiple", 1)
    return math.ceil(config.vocab_size / multiple) * multiple


def attention_layout(config):
    """(head_dim, n_head, n_head_kv) of a GPT config."""
    head_dim = getattr(config, "head_dim", None) or config.n_embd // config.n_head
    return head_dim, config.n_head, getattr(config, "n_head_kv", None) or config.n_head


def pad_vocab(t, vocab_size):
    """Embedding / lm_head rows (or an lm_head bias) zero-padded to vocab_size entries."""
    pad = vocab_size - t.shape[0]
    if pad < 0:
        raise ValueError(f"a vocabulary tensor has {t.shape[0]} rows, more than the config's "
                         f"padded vocab_size {vocab_size}")
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


def put_gpt2_top_level(out, key, value, vocab_size):
    """GPT-2-layout checkpoints (GPT-2, GPTBigCode, BTLM) share their non-layer keys: wte, wpe,
    ln_f and lm_head (the transformer. prefix already stripped). Puts key into out under our name
    (vocabulary rows padded to vocab_size) and returns True, or returns False for any other key."""
    if key in ("wte.weight", "lm_head.weight"):
        name = ("transformer.embeddings.word_embeddings.weight" if key == "wte.weight" else key)
        out[name] = pad_vocab(value, vocab_size)
    elif key == "wpe.weight":
        out["transformer.embeddings.position_embeddings.weight"] = value
    elif key.startswith("ln_f."):
        out["transformer." + key] = value
    else:
        return False
    return True


def tie_lm_head(out, config):
    """lm_head.weight is the word embeddings when the config ties them or the checkpoint has
    no head of its own."""
    if getattr(config, "tie_word_embeddings", True) or "lm_head.weight" not in out:
        out["lm_head.weight"] = out["transformer.embeddings.word_embeddings.weight"]
    return out


# ----------------------------------------------------------------------------------------------
# Tensor parallelism: column-parallel Wqkv / fc1 / lm_head / word embeddings (rows split),
# row-parallel out_proj / fc2 (columns split), norms replicated.
# ----------------------------------------------------------------------------------------------


def _rank_range(total, world_size, rank, multiple_of=1):
    """[start, stop) of this rank's share, split as utils.distributed.get_dim_for_local_rank does."""
    from flash_attn.utils.distributed import get_dim_for_local_rank

    sizes = [get_dim_for_local_rank(total, world_size, r, multiple_of) for r in range(world_size)]
    if sum(sizes) != total:
        raise ValueError(f"cannot split {total} over {world_size} ranks in multiples of {multiple_of}")
    start = sum(sizes[:rank])
    return start, start + sizes[rank]


def _is_gated(config):
    return config.activation_function in GATED_ACTIVATIONS


def _mlp_multiple(config):
    return getattr(config, "mlp_multiple_of", 128) if _is_gated(config) else 1


def shard_state_dict_tp(state_dict, config, world_size, rank):
    """The full state dict -> rank's shard for GPTLMHeadModel(config, process_group) with
    world_size ranks. Row-parallel biases (out_proj, fc2) live on rank 0 only."""
    head_dim, n_head, n_head_kv = attention_layout(config)
    parts = [n_head * head_dim, n_head_kv * head_dim, n_head_kv * head_dim]
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
        chunks = x.chunk(2 if _is_gated(config) else 1, dim=0)
        start, stop = _rank_range(chunks[0].shape[0], world_size, rank, _mlp_multiple(config))
        return torch.cat([c[start:stop] for c in chunks], dim=0)

    out = OrderedDict()
    for key, value in state_dict.items():
        if key in VOCAB_KEYS:
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


def _join_vocab(shards, config):
    """Vocabulary tensors: rows split over ranks (ours, Meta's Llama 3), or the embedding dim
    split (Meta's Llama 1/2 ParallelEmbedding: the shards' columns add up to the model width).
    Rows a sharded checkpoint could not pad per shard are padded here."""
    width = getattr(config, "word_embed_proj_dim", None) or config.n_embd
    split_columns = (len(shards) > 1 and shards[0].dim() == 2
                     and sum(s.shape[1] for s in shards) == width)
    value = torch.cat(shards, dim=1 if split_columns else 0)
    if value.shape[0] < padded_vocab_size(config):
        value = pad_vocab(value, padded_vocab_size(config))
    return value


def combine_state_dicts_tp(state_dicts, config):
    """The inverse of shard_state_dict_tp: the ranks' state dicts (in rank order) -> one. Also
    merges Meta's model-parallel Llama shards once each is remapped (llama.py)."""
    world_size = len(state_dicts)
    head_dim, n_head, n_head_kv = attention_layout(config)
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
        n = 2 if _is_gated(config) else 1
        chunks = [s.chunk(n, dim=0) for s in shards]
        return torch.cat([c[i] for i in range(n) for c in chunks], dim=0)

    out = OrderedDict()
    for key, value in state_dicts[0].items():
        shards = [sd[key] for sd in state_dicts if key in sd]  # row-parallel biases: rank 0
        if key in VOCAB_KEYS:
            value = _join_vocab(shards, config)
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
