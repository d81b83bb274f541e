"""Token + position embeddings (GPT-2, BERT) and their tensor-parallel forms: the vocabulary split
over ranks by rows (VocabParallelEmbedding), positions split by columns (ColumnParallelEmbedding);
the partial sums meet in one all-reduce, or a reduce-scatter with sequence parallelism."""

import torch
import torch.nn as nn
from einops import rearrange


def _positions(input_ids, position_ids):
    if position_ids is not None:
        return position_ids
    return torch.arange(input_ids.shape[1], dtype=torch.long, device=input_ids.device)


class GPT2Embeddings(nn.Module):
    """word_embed_proj_dim (OPT-350m): the word embeddings live in a smaller space and are
    projected up to embed_dim. max_position_embeddings <= 0: no learned positions (rotary)."""

    def __init__(self, embed_dim, vocab_size, max_position_embeddings, padding_idx=None,
                 word_embed_proj_dim=None, device=None, dtype=None):
        factory = {"device": device, "dtype": dtype}
        super().__init__()
        if word_embed_proj_dim is None:
            self.word_embeddings = nn.Embedding(vocab_size, embed_dim, padding_idx=padding_idx,
                                                **factory)
            self.project_in = None
        else:
            self.word_embeddings = nn.Embedding(vocab_size, word_embed_proj_dim,
                                                padding_idx=padding_idx, **factory)
            self.project_in = nn.Linear(word_embed_proj_dim, embed_dim, bias=False, **factory)
        self.max_position_embeddings = max_position_embeddings
        if max_position_embeddings > 0:
            self.position_embeddings = nn.Embedding(max_position_embeddings, embed_dim, **factory)

    def forward(self, input_ids, position_ids=None):
        """input_ids (b, s) -> (b, s, embed_dim)."""
        embeddings = self.word_embeddings(input_ids)
        if self.project_in is not None:
            embeddings = self.project_in(embeddings)
        if self.max_position_embeddings > 0:
            embeddings = embeddings + self.position_embeddings(_positions(input_ids, position_ids))
        return embeddings


class BertEmbeddings(nn.Module):
    """Word + position + token-type embeddings (the LayerNorm after them belongs to the model)."""

    def __init__(self, embed_dim, vocab_size, max_position_embeddings, type_vocab_size,
                 padding_idx=None, device=None, dtype=None):
        factory = {"device": device, "dtype": dtype}
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab_size, embed_dim, padding_idx=padding_idx,
                                            **factory)
        self.max_position_embeddings, self.type_vocab_size = max_position_embeddings, type_vocab_size
        if max_position_embeddings > 0:
            self.position_embeddings = nn.Embedding(max_position_embeddings, embed_dim, **factory)
        if type_vocab_size > 0:
            self.token_type_embeddings = nn.Embedding(type_vocab_size, embed_dim, **factory)

    def forward(self, input_ids, position_ids=None, token_type_ids=None):
        embeddings = self.word_embeddings(input_ids)
        if self.max_position_embeddings > 0:
            embeddings = embeddings + self.position_embeddings(_positions(input_ids, position_ids))
        if self.type_vocab_size > 0:
            if token_type_ids is None:
                token_type_ids = torch.zeros_like(input_ids)
            embeddings = embeddings + self.token_type_embeddings(token_type_ids)
        return embeddings


# ----------------------------------------------------------------------------------------------
# Tensor parallel.
# ----------------------------------------------------------------------------------------------


def _local_size(owner, name, size, process_group):
    """This rank's equal share of size; owner and name say what is split, in the error."""
    world_size = torch.distributed.get_world_size(process_group)
    if size % world_size != 0:
        raise ValueError(f"{owner}: {name} ({size}) must be divisible by the world size "
                         f"({world_size})")
    return size // world_size


class VocabParallelEmbedding(nn.Embedding):
    """This rank's contiguous block of num_embeddings / world_size rows. Ids outside the block
    give zero vectors, so summing over ranks (the caller's reduction) gives the full lookup."""

    def __init__(self, num_embeddings, *args, process_group=None, padding_idx=None, **kwargs):
        self.process_group = process_group
        if process_group is not None:
            local = _local_size("VocabParallelEmbedding", "num_embeddings", num_embeddings,
                                process_group)
            if padding_idx is not None and torch.distributed.get_world_size(process_group) > 1:
                raise ValueError("VocabParallelEmbedding: padding_idx is not supported with "
                                 "more than one rank")
            num_embeddings = local
        super().__init__(num_embeddings, *args, padding_idx=padding_idx, **kwargs)

    def forward(self, input):
        if self.process_group is None:
            return super().forward(input)
        rank = torch.distributed.get_rank(self.process_group)
        start = rank * self.num_embeddings
        outside = (input < start) | (input >= start + self.num_embeddings)
        local = (input - start).masked_fill(outside, 0)
        return super().forward(local).masked_fill(outside.unsqueeze(-1), 0.0)


class ColumnParallelEmbedding(nn.Embedding):
    """This rank's slice of embedding_dim / world_size columns."""

    def __init__(self, num_embeddings, embedding_dim, *args, process_group=None, **kwargs):
        self.process_group = process_group
        if process_group is not None:
            embedding_dim = _local_size("ColumnParallelEmbedding", "embedding_dim", embedding_dim,
                                        process_group)
        super().__init__(num_embeddings, embedding_dim, *args, **kwargs)


class ParallelGPT2Embeddings(nn.Module):
    def __init__(self, embed_dim, vocab_size, max_position_embeddings, process_group,
                 padding_idx=None, sequence_parallel=True, device=None, dtype=None):
        factory = {"device": device, "dtype": dtype}
        super().__init__()
        self.process_group, self.sequence_parallel = process_group, sequence_parallel
        self.word_embeddings = VocabParallelEmbedding(vocab_size, embed_dim,
                                                      padding_idx=padding_idx,
                                                      process_group=process_group, **factory)
        self.max_position_embeddings = max_position_embeddings
        if max_position_embeddings > 0:
            self.position_embeddings = ColumnParallelEmbedding(
                max_position_embeddings, embed_dim, process_group=process_group, **factory)

    def forward(self, input_ids, position_ids=None, combine_batch_seqlen_dim=False):
        """input_ids (b, s) -> (b, s, d), or (b * s, d) rows with combine_batch_seqlen_dim; with
        sequence_parallel, this rank's 1/world_size share of those rows."""
        from flash_attn.utils.distributed import all_reduce, reduce_scatter

        embeddings = self.word_embeddings(input_ids)
        if self.max_position_embeddings > 0:
            positions = self.position_embeddings(_positions(input_ids, position_ids))
            # This rank holds columns [rank * d_local, (rank + 1) * d_local) of the positions.
            rank = torch.distributed.get_rank(self.process_group)
            d_local = positions.shape[-1]
            embeddings = embeddings.clone()
            embeddings[..., rank * d_local: (rank + 1) * d_local] += positions
        if combine_batch_seqlen_dim:
            embeddings = rearrange(embeddings, "b s d -> (b s) d")
        reduce_fn = reduce_scatter if self.sequence_parallel else all_reduce
        return reduce_fn(embeddings, self.process_group)
