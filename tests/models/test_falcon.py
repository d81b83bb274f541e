"""Falcon checkpoints on GPTLMHeadModel: the logits and greedy tokens of transformers'
FalconForCausalLM, for both decoder architectures and their key/value layouts."""

import pytest
import torch
from transformers import FalconConfig, FalconForCausalLM

from flash_attn.models.falcon import falcon_config_to_gpt2_config, remap_state_dict_hf_falcon
from flash_attn.models.gpt import GPTLMHeadModel
from flash_attn.utils.testing import assert_causal_lm_matches_hf

VOCAB = 100

CASES = {
    # Falcon-7B: one key/value head, attention and MLP in parallel from one norm.
    "old-multi-query-parallel": dict(new_decoder_architecture=False, multi_query=True,
                                     parallel_attn=True),
    # Falcon-RW (with rotary): per-head [q, k, v], sequential block, biases.
    "old-sequential-bias": dict(new_decoder_architecture=False, multi_query=False,
                                parallel_attn=False, bias=True),
    # Falcon-40B / 180B: grouped key/value heads, ln_attn and ln_mlp.
    "new-grouped-two-norms": dict(new_decoder_architecture=True, num_kv_heads=2),
    "new-grouped-one-norm": dict(new_decoder_architecture=True, num_kv_heads=2,
                                 num_ln_in_parallel_attn=1),
}


def _falcon_config(**kwargs):
    # initializer_range 0.2: a random model whose greedy choices are clear-cut (see test_gpt).
    base = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=VOCAB,
                initializer_range=0.2, bos_token_id=0, eos_token_id=1, ffn_hidden_size=96)
    base.update(kwargs)
    return FalconConfig(**base)


def _hf_and_ours(falcon_config):
    torch.manual_seed(0)
    hf = FalconForCausalLM(falcon_config).eval()
    config = falcon_config_to_gpt2_config(falcon_config)
    ours = GPTLMHeadModel(config).eval()
    ours.load_state_dict(remap_state_dict_hf_falcon(hf.state_dict(), config))
    return hf, ours, config


@pytest.mark.parametrize("case", list(CASES))
def test_falcon_matches_hf(case):
    hf, ours, config = _hf_and_ours(_falcon_config(**CASES[case]))
    expected_kv = {"old-multi-query-parallel": 1, "old-sequential-bias": 4}.get(case, 2)
    assert config.n_head_kv == expected_kv
    assert_causal_lm_matches_hf(hf, ours, VOCAB, min_distinct_tokens=3)


def test_falcon_from_pretrained_reads_model_type(tmp_path):
    falcon_config = _falcon_config(**CASES["new-grouped-two-norms"])
    hf, _, config = _hf_and_ours(falcon_config)
    hf.save_pretrained(tmp_path)
    ours = GPTLMHeadModel.from_pretrained(str(tmp_path), config).eval()
    ids = torch.randint(2, VOCAB, (1, 9))
    with torch.no_grad():
        assert (ours(ids).logits - hf(ids).logits).abs().max().item() <= 1e-4


def test_falcon_remote_code_config_names():
    """The remote-code RefinedWeb (40B) config: n_head / n_layer / n_head_kv, no
    new_decoder_architecture attribute."""
    from transformers import PretrainedConfig

    refined_web = PretrainedConfig(
        model_type="RefinedWeb", vocab_size=VOCAB, hidden_size=64, n_head=4, n_layer=2,
        n_head_kv=2, parallel_attn=True, bias=False, layer_norm_epsilon=1e-5,
        initializer_range=0.02, bos_token_id=0, eos_token_id=1)
    config = falcon_config_to_gpt2_config(refined_web)
    assert (config.n_layer, config.n_head, config.n_head_kv) == (2, 4, 2)
    assert config.parallel_block and not config.parallel_block_tied_norm
    assert config.n_inner == 256


def test_falcon_unsupported_configs_raise():
    with pytest.raises(NotImplementedError, match="alibi"):
        falcon_config_to_gpt2_config(_falcon_config(alibi=True))
    with pytest.raises(NotImplementedError, match="activation"):
        falcon_config_to_gpt2_config(_falcon_config(activation="silu"))
