import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from flash_attn.models.gpt import GPTLMHeadModel
from flash_attn.models.llama import (
    inv_remap_state_dict_hf_llama,
    llama_config_to_gpt2_config,
    remap_state_dict_hf_llama,
)

VOCAB = 100


def _llama_config(**kwargs):
    # initializer_range 0.2: a random model whose greedy choices are clear-cut (see test_gpt).
    base = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=96, vocab_size=VOCAB, initializer_range=0.2, rms_norm_eps=1e-5,
                max_position_embeddings=128, bos_token_id=0, eos_token_id=1, pad_token_id=0)
    base.update(kwargs)
    return LlamaConfig(**base)


def _hf_and_ours(llama_config, **flags):
    torch.manual_seed(0)
    hf = LlamaForCausalLM(llama_config).eval()
    config = llama_config_to_gpt2_config(llama_config)
    for name, value in flags.items():
        setattr(config, name, value)
    ours = GPTLMHeadModel(config).eval()
    ours.load_state_dict(remap_state_dict_hf_llama(hf.state_dict(), config))
    return hf, ours, config


@pytest.mark.parametrize("options", [{}, {"num_key_value_heads": 4},
                                     {"tie_word_embeddings": True, "attention_bias": True},
                                     {"rope_theta": 500000.0}])
def test_llama_matches_hf(options):
    hf, ours, config = _hf_and_ours(_llama_config(**options))
    assert config.rotary_emb_base == options.get("rope_theta", 10000.0)
    ids = torch.randint(0, VOCAB, (2, 20))
    with torch.no_grad():
        out_hf = hf(ids, labels=ids)
        logits = ours(ids).logits
    assert (logits - out_hf.logits).abs().max().item() <= 1e-4
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    assert abs(loss.item() - out_hf.loss.item()) <= 1e-5


def test_llama_padded_vocab_and_inverse_remap():
    hf, ours, config = _hf_and_ours(_llama_config(), pad_vocab_size_multiple=64)
    assert ours.lm_head.weight.shape[0] == 128
    back = inv_remap_state_dict_hf_llama(ours.state_dict(), config)
    reference = hf.state_dict()
    assert set(back) == set(reference)
    for key, value in reference.items():
        assert torch.equal(back[key], value), key


def test_llama_greedy_generation_matches_hf():
    hf, ours, _ = _hf_and_ours(_llama_config())
    torch.manual_seed(1)
    prompt = torch.randint(2, VOCAB, (2, 7))
    with torch.no_grad():
        expected = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_length=28,
                               do_sample=False, eos_token_id=None, pad_token_id=0)
    assert len(expected[0, 7:].unique()) > 3
    assert torch.equal(ours.generate(prompt, max_length=28), expected)


def test_unsupported_llama_configs_raise():
    with pytest.raises(NotImplementedError, match="rope"):
        llama_config_to_gpt2_config(_llama_config(rope_scaling={"rope_type": "linear", "factor": 2.0}))
    with pytest.raises(NotImplementedError, match="head_dim"):
        llama_config_to_gpt2_config(_llama_config(head_dim=32))


@pytest.mark.gpu
def test_llama_fused_matches_hf_gpu():
    llama_config = _llama_config(hidden_size=512, num_attention_heads=8, num_key_value_heads=2,
                                 intermediate_size=1024, vocab_size=1000, initializer_range=0.02)
    torch.manual_seed(0)
    hf = LlamaForCausalLM(llama_config).to("cuda").eval()
    config = llama_config_to_gpt2_config(llama_config)
    config.update(dict(use_flash_attn=True, fused_bias_fc=True, fused_dropout_add_ln=True,
                       residual_in_fp32=True))
    ours = GPTLMHeadModel(config, device="cuda", dtype=torch.bfloat16).eval()
    ours.load_state_dict(remap_state_dict_hf_llama(hf.state_dict(), config))
    hf_lowp = LlamaForCausalLM(llama_config).to("cuda", torch.bfloat16).eval()
    hf_lowp.load_state_dict(hf.state_dict())
    ids = torch.randint(0, 1000, (2, 300), device="cuda")
    with torch.no_grad():
        ref = hf(ids).logits.float()
        err = (ours(ids).logits.float() - ref).abs().max().item()
        base = (hf_lowp(ids).logits.float() - ref).abs().max().item()
    # flash-attn's model-test bound: 3x the error of the bf16 HF model.
    assert err <= 3 * base + 1e-3, (err, base)
