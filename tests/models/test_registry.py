"""The model-family registry: families found by HF model_type and by key markers, families
imported lazily and never importing gpt.py."""

import json
import subprocess
import sys

import pytest
import torch
import transformers as T

from flash_attn.models import registry
from flash_attn.models.falcon import falcon_config_to_gpt2_config
from flash_attn.models.registry import (
    ModelFamily,
    checkpoint_model_type,
    family_for_model_type,
    family_for_state_dict,
    gpt2_config_from_hf_config,
    register_family,
    remap_state_dict_any,
)

SMALL = dict(vocab_size=100, initializer_range=0.02, bos_token_id=0, eos_token_id=1)
LAYERS = dict(num_hidden_layers=1, hidden_size=32, num_attention_heads=4)

HF_CASES = {  # family name -> an HF model of its layout
    "gpt2": lambda: T.GPT2LMHeadModel(T.GPT2Config(n_layer=1, n_embd=32, n_head=4, **SMALL)),
    "gpt_bigcode": lambda: T.GPTBigCodeForCausalLM(
        T.GPTBigCodeConfig(n_layer=1, n_embd=32, n_head=4, **SMALL)),
    "opt": lambda: T.OPTForCausalLM(T.OPTConfig(ffn_dim=64, pad_token_id=1, **LAYERS, **SMALL)),
    "llama": lambda: T.LlamaForCausalLM(T.LlamaConfig(intermediate_size=64, **LAYERS, **SMALL)),
    "falcon": lambda: T.FalconForCausalLM(T.FalconConfig(**LAYERS, **SMALL)),
    "gpt_neox": lambda: T.GPTNeoXForCausalLM(
        T.GPTNeoXConfig(intermediate_size=64, **LAYERS, **SMALL)),
    "gptj": lambda: T.GPTJForCausalLM(T.GPTJConfig(n_layer=1, n_embd=32, n_head=4, rotary_dim=4,
                                                   **SMALL)),
}

KEY_CASES = {  # family name -> keys of its layout (remote-code or original checkpoints)
    "baichuan": ["model.embed_tokens.weight", "model.layers.0.self_attn.W_pack.weight",
                 "model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.gate_proj.weight"],
    "btlm": ["transformer.wte.weight", "transformer.h.0.attn.c_attn.weight",
             "transformer.h.0.mlp.c_fc2.weight", "transformer.relative_pe.slopes"],
    "megatron": ["language_model.embedding.word_embeddings.weight",
                 "language_model.encoder.layers.0.self_attention.query_key_value.weight"],
    "meta_llama": ["tok_embeddings.weight", "layers.0.attention.wq.weight",
                   "layers.0.feed_forward.w1.weight"],
}


@pytest.mark.parametrize("name", list(HF_CASES))
def test_hf_layouts_found_by_key_marker(name):
    torch.manual_seed(0)
    state_dict = HF_CASES[name]().state_dict()
    assert family_for_state_dict(state_dict).name == name


@pytest.mark.parametrize("name", list(KEY_CASES))
def test_other_layouts_found_by_key_marker(name):
    state_dict = {key: torch.zeros(1, 1) for key in KEY_CASES[name]}
    assert family_for_state_dict(state_dict).name == name


def test_families_by_model_type():
    expected = {"gpt2": "gpt2", "llama": "llama", "gpt_neox": "gpt_neox", "gptj": "gptj",
                "opt": "opt", "falcon": "falcon", "RefinedWeb": "falcon",
                "RefinedWebModel": "falcon", "gpt_bigcode": "gpt_bigcode",
                "baichuan": "baichuan", "btlm": "btlm"}
    for model_type, name in expected.items():
        assert family_for_model_type(model_type).name == name, model_type
    assert family_for_model_type("mistral") is None
    falcon = T.FalconConfig(**LAYERS, **SMALL)
    assert gpt2_config_from_hf_config(falcon).to_dict() == \
        falcon_config_to_gpt2_config(falcon).to_dict()
    with pytest.raises(ValueError, match="mistral"):
        gpt2_config_from_hf_config(T.MistralConfig())


def test_remap_state_dict_any_choice():
    torch.manual_seed(0)
    llama = T.LlamaConfig(intermediate_size=64, **LAYERS, **SMALL)
    state_dict = T.LlamaForCausalLM(llama).state_dict()
    config = gpt2_config_from_hf_config(llama)
    ours = remap_state_dict_any(state_dict, config, model_type="llama")
    assert "transformer.layers.0.mixer.Wqkv.weight" in ours
    assert remap_state_dict_any(ours, config) is ours  # already ours
    # A model_type no family claims (Mistral has Llama's layout): found by its key names.
    by_keys = remap_state_dict_any(state_dict, config, model_type="mistral")
    assert all(torch.equal(by_keys[k], v) for k, v in ours.items())
    with pytest.raises(ValueError, match="unrecognised checkpoint layout"):
        remap_state_dict_any({"encoder.block.0.weight": torch.zeros(1)}, config)


def test_checkpoint_model_type(tmp_path):
    torch.save({"w": torch.zeros(1)}, tmp_path / "pytorch_model.bin")
    assert checkpoint_model_type(str(tmp_path)) is None
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "falcon"}))
    assert checkpoint_model_type(str(tmp_path)) == "falcon"
    assert checkpoint_model_type(str(tmp_path / "pytorch_model.bin")) == "falcon"


def test_register_family_checks_its_argument():
    with pytest.raises(TypeError, match="ModelFamily"):
        register_family({"name": "mine"})
    # A family outside FAMILY_MODULES is consulted after the listed ones.
    mine = ModelFamily(name="test_only", module="tests.models.test_registry",
                       model_types=("test_only",), remap_state_dict=lambda sd, config: sd,
                       matches=lambda sd: "mine.weight" in sd)
    register_family(mine)
    try:
        assert registry.families()[-1] is mine
        assert family_for_state_dict({"mine.weight": torch.zeros(1)}) is mine
    finally:
        registry._FAMILIES.pop("test_only")


def test_families_do_not_import_gpt():
    """Each family module is a leaf: importing it (and the registry's lookups) leaves
    flash_attn.models.gpt unimported, except for GPT-2's own family, which lives there."""
    code = ("import sys\n"
            "from flash_attn.models import registry\n"
            "for name in registry.FAMILY_MODULES:\n"
            "    if name != 'flash_attn.models.gpt':\n"
            "        __import__(name)\n"
            "assert 'flash_attn.models.gpt' not in sys.modules, 'a family imported gpt.py'\n"
            "print('OK')\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-2000:]
