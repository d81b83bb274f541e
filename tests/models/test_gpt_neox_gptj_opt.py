"""GPT-NeoX, GPT-J and OPT checkpoints on GPTLMHeadModel: the same logits as HF's models."""

import pytest
import torch
import transformers as T

from flash_attn.models.gpt import GPTLMHeadModel
from flash_attn.utils.testing import assert_causal_lm_matches_hf
from flash_attn.models.gpt_neox import gpt_neox_config_to_gpt2_config, remap_state_dict_hf_gpt_neox
from flash_attn.models.gptj import gptj_config_to_gpt2_config, remap_state_dict_hf_gptj
from flash_attn.models.opt import opt_config_to_gpt2_config, remap_state_dict_hf_opt

VOCAB = 100
SMALL = dict(initializer_range=0.2, bos_token_id=0, eos_token_id=1, vocab_size=VOCAB)

CASES = {
    "neox-parallel": (T.GPTNeoXConfig, T.GPTNeoXForCausalLM, gpt_neox_config_to_gpt2_config,
                      remap_state_dict_hf_gpt_neox,
                      dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                           intermediate_size=96, **SMALL)),
    "neox-sequential": (T.GPTNeoXConfig, T.GPTNeoXForCausalLM, gpt_neox_config_to_gpt2_config,
                        remap_state_dict_hf_gpt_neox,
                        dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                             intermediate_size=96, use_parallel_residual=False, **SMALL)),
    "gptj": (T.GPTJConfig, T.GPTJForCausalLM, gptj_config_to_gpt2_config, remap_state_dict_hf_gptj,
             dict(n_layer=2, n_embd=64, n_head=4, rotary_dim=8, **SMALL)),
    "opt": (T.OPTConfig, T.OPTForCausalLM, opt_config_to_gpt2_config, remap_state_dict_hf_opt,
            dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, ffn_dim=96,
                 max_position_embeddings=64, dropout=0.0, pad_token_id=1, **SMALL)),
    "opt-350m-like": (T.OPTConfig, T.OPTForCausalLM, opt_config_to_gpt2_config,
                      remap_state_dict_hf_opt,
                      dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, ffn_dim=96,
                           max_position_embeddings=64, dropout=0.0, pad_token_id=1,
                           word_embed_proj_dim=32, do_layer_norm_before=False, **SMALL)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_hf(case):
    config_cls, model_cls, convert, remap, kwargs = CASES[case]
    hf_config = config_cls(**kwargs)
    torch.manual_seed(0)
    hf = model_cls(hf_config).eval()
    config = convert(hf_config)
    ours = GPTLMHeadModel(config).eval()
    ours.load_state_dict(remap(hf.state_dict(), config))
    assert_causal_lm_matches_hf(hf, ours, VOCAB)


@pytest.mark.parametrize("case", ["neox-parallel", "gptj", "opt"])
def test_from_pretrained_picks_the_remap(case, tmp_path):
    config_cls, model_cls, convert, _, kwargs = CASES[case]
    hf_config = config_cls(**kwargs)
    torch.manual_seed(0)
    hf = model_cls(hf_config).eval()
    hf.save_pretrained(tmp_path)
    ours = GPTLMHeadModel.from_pretrained(str(tmp_path), convert(hf_config)).eval()
    ids = torch.randint(2, VOCAB, (1, 9))
    with torch.no_grad():
        assert (ours(ids).logits - hf(ids).logits).abs().max().item() <= 1e-4
