"""Shared checkpoint helpers (the tensor-parallel shard / combine round trip is in test_gpt.py,
the merge of Meta's Llama shards in test_llama.py)."""

import pytest
import torch
from transformers import GPT2Config

from flash_attn.models import checkpoint, gpt, registry
from flash_attn.models.checkpoint import pad_vocab, split_layer_key, stack_qkv, tie_lm_head


def test_names_still_importable_from_gpt():
    for name in ("pad_vocab", "padded_vocab_size", "split_layer_key", "stack_qkv",
                 "shard_state_dict_tp", "combine_state_dicts_tp"):
        assert getattr(gpt, name) is getattr(checkpoint, name), name
    assert gpt.remap_state_dict_any is registry.remap_state_dict_any
    assert set(gpt.GATED) == set(checkpoint.GATED_ACTIVATIONS)  # fc1 = [value; gate] for these


def test_pad_vocab():
    rows = torch.randn(5, 3)
    padded = pad_vocab(rows, 8)
    assert padded.shape == (8, 3) and torch.equal(padded[:5], rows) and not padded[5:].any()
    assert pad_vocab(torch.ones(5), 6).tolist() == [1, 1, 1, 1, 1, 0]
    with pytest.raises(ValueError, match="more than the config's padded vocab_size 4"):
        pad_vocab(rows, 4)


def test_split_layer_key_and_stack_qkv():
    assert split_layer_key(r"h\.", "h.3.attn.c_attn.weight", "caller") == \
        ("3", "attn.c_attn", "weight")
    with pytest.raises(KeyError, match="caller: unexpected key 'wte.weight'"):
        split_layer_key(r"h\.", "wte.weight", "caller")
    q, k, v = torch.zeros(4, 2), torch.ones(2, 2), torch.full((2, 2), 2.0)
    out = {}
    stack_qkv(out, {("0", "q", "weight"): q, ("0", "k", "weight"): k, ("0", "v", "weight"): v})
    assert torch.equal(out["transformer.layers.0.mixer.Wqkv.weight"], torch.cat([q, k, v]))


def test_tie_lm_head():
    embeddings, head = torch.zeros(3, 2), torch.ones(3, 2)
    untied = GPT2Config(tie_word_embeddings=False)
    out = tie_lm_head({"transformer.embeddings.word_embeddings.weight": embeddings,
                       "lm_head.weight": head}, untied)
    assert out["lm_head.weight"] is head
    out = tie_lm_head({"transformer.embeddings.word_embeddings.weight": embeddings}, untied)
    assert out["lm_head.weight"] is embeddings  # no head of its own
    out = tie_lm_head({"transformer.embeddings.word_embeddings.weight": embeddings,
                       "lm_head.weight": head}, GPT2Config())
    assert out["lm_head.weight"] is embeddings
