"""GPTBigCode (StarCoder) checkpoints on GPTLMHeadModel: the logits and greedy tokens of
transformers' GPTBigCodeForCausalLM, and the way back to its state dict."""

import pytest
import torch
from transformers import GPTBigCodeConfig, GPTBigCodeForCausalLM

from flash_attn.models.bigcode import (
    bigcode_config_to_gpt2_config,
    inv_remap_state_dict_hf_bigcode,
    remap_state_dict_hf_bigcode,
)
from flash_attn.models.gpt import GPTLMHeadModel
from flash_attn.utils.testing import assert_causal_lm_matches_hf

VOCAB = 100


def _bigcode_config(**kwargs):
    # initializer_range 0.2: a random model whose greedy choices are clear-cut (see test_gpt).
    base = dict(n_layer=2, n_embd=64, n_head=4, n_inner=96, vocab_size=VOCAB, n_positions=64,
                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, initializer_range=0.2,
                bos_token_id=0, eos_token_id=1)
    base.update(kwargs)
    return GPTBigCodeConfig(**base)


def _hf_and_ours(bigcode_config, **flags):
    torch.manual_seed(0)
    hf = GPTBigCodeForCausalLM(bigcode_config).eval()
    config = bigcode_config_to_gpt2_config(bigcode_config)
    config.update(flags)
    ours = GPTLMHeadModel(config).eval()
    ours.load_state_dict(remap_state_dict_hf_bigcode(hf.state_dict(), config))
    return hf, ours, config


@pytest.mark.parametrize("multi_query", [True, False])
def test_bigcode_matches_hf(multi_query):
    hf, ours, config = _hf_and_ours(_bigcode_config(multi_query=multi_query))
    assert ours.transformer.layers[0].mixer.num_heads_kv == (1 if multi_query else 4)
    assert_causal_lm_matches_hf(hf, ours, VOCAB, min_distinct_tokens=3)


@pytest.mark.parametrize("multi_query,repeat_kv", [(True, False), (False, False), (True, True)])
def test_bigcode_inverse_remap_roundtrip(multi_query, repeat_kv):
    """Back to HF's state dict, also from a config whose Wqkv repeats the single key/value
    head for every query head (n_head_kv unset, as with flash-attn's converter)."""
    flags = dict(n_head_kv=None, pad_vocab_size_multiple=16) if repeat_kv else {}
    hf, ours, config = _hf_and_ours(_bigcode_config(multi_query=multi_query), **flags)
    ids = torch.randint(2, VOCAB, (1, 12))
    with torch.no_grad():
        assert (ours(ids).logits[..., :VOCAB] - hf(ids).logits).abs().max().item() <= 1e-4
    back = inv_remap_state_dict_hf_bigcode(ours.state_dict(), config)
    reference = hf.state_dict()
    assert set(back) == set(reference)
    for key, value in reference.items():
        assert torch.equal(back[key], value), key


def test_bigcode_from_pretrained_reads_model_type(tmp_path):
    hf, _, config = _hf_and_ours(_bigcode_config())
    hf.save_pretrained(tmp_path)
    ours = GPTLMHeadModel.from_pretrained(str(tmp_path), config).eval()
    ids = torch.randint(2, VOCAB, (1, 9))
    with torch.no_grad():
        assert (ours(ids).logits - hf(ids).logits).abs().max().item() <= 1e-4
