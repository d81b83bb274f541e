"""BTLM (remote code; no transformers class): a synthetic checkpoint with the published key
names, remapped onto GPTLMHeadModel, against a plain PyTorch reading of the published model
(GPT-2's Conv1D block, ALiBi or learned positions, SwiGLU c_fc * silu(c_fc2), muP scales)."""

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import PretrainedConfig

from flash_attn.models.btlm import btlm_config_to_gpt2_config, remap_state_dict_hf_btlm
from flash_attn.models.gpt import GPTLMHeadModel
from flash_attn.modules.mha import get_alibi_slopes

VOCAB, LAYERS, HIDDEN, INNER, HEADS, POSITIONS = 100, 2, 48, 80, 6, 32

CASES = {
    # btlm-3b-8k's settings: ALiBi, queries . keys / d, muP multipliers.
    "alibi-mup": dict(position_embedding_type="alibi", mup_width_scale=0.1,
                      mup_embeddings_scale=14.6, mup_output_alpha=2.22,
                      mup_scale_qk_dot_by_d=True),
    "learned-positions": dict(position_embedding_type="learned", mup_width_scale=1.0,
                              mup_embeddings_scale=1.0, mup_output_alpha=1.0,
                              mup_scale_qk_dot_by_d=False),
}


def _btlm_config(case):
    return PretrainedConfig(
        model_type="btlm", vocab_size=VOCAB, n_positions=POSITIONS, n_embd=HIDDEN, n_layer=LAYERS,
        n_head=HEADS, n_inner=INNER, activation_function="swiglu", resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=1e-5, initializer_range=0.02,
        scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False, alibi_scaling=None,
        bos_token_id=0, eos_token_id=1, **CASES[case])


def _alibi_slopes(n):
    """The ALiBi paper's slopes (BTLM's AlibiPositionEmbeddingLayer._get_alibi_slopes)."""
    if math.log2(n).is_integer():
        return [2 ** (-8 * (i + 1) / n) for i in range(n)]
    lower = 2 ** math.floor(math.log2(n))
    return _alibi_slopes(lower) + _alibi_slopes(2 * lower)[0::2][: n - lower]


def _published_checkpoint(case, seed=0):
    """Random weights under BTLM's key names (Conv1D: (in, out)), the causal-mask buffers and
    the ALiBi slopes it stores, and the tied head."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.2):
        return torch.randn(*shape, generator=gen) * scale

    wte = rand(VOCAB, HIDDEN, scale=1.0)
    sd = {"transformer.wte.weight": wte, "lm_head.weight": wte,
          "transformer.ln_f.weight": 1 + rand(HIDDEN), "transformer.ln_f.bias": rand(HIDDEN)}
    if CASES[case]["position_embedding_type"] == "alibi":
        sd["transformer.relative_pe.slopes"] = torch.tensor(_alibi_slopes(HEADS)).unsqueeze(-1)
    else:
        sd["transformer.wpe.weight"] = rand(POSITIONS, HIDDEN, scale=0.1)
    for i in range(LAYERS):
        p = f"transformer.h.{i}."
        shapes = {"attn.c_attn": (HIDDEN, 3 * HIDDEN), "attn.c_proj": (HIDDEN, HIDDEN),
                  "mlp.c_fc": (HIDDEN, INNER), "mlp.c_fc2": (HIDDEN, INNER),
                  "mlp.c_proj": (INNER, HIDDEN)}
        for name, (d_in, d_out) in shapes.items():
            sd[p + name + ".weight"], sd[p + name + ".bias"] = rand(d_in, d_out), rand(d_out)
        for name in ("ln_1", "ln_2"):
            sd[p + name + ".weight"], sd[p + name + ".bias"] = 1 + rand(HIDDEN), rand(HIDDEN)
        sd[p + "attn.bias"] = torch.ones(1, 1, POSITIONS, POSITIONS).tril()
        sd[p + "attn.masked_bias"] = torch.tensor(-1e4)
    return sd


def _reference_logits(sd, ids, case):
    """BTLM's published forward, read plainly."""
    options = CASES[case]
    seqlen, head_dim = ids.shape[1], HIDDEN // HEADS
    x = sd["transformer.wte.weight"][ids]
    if "transformer.wpe.weight" in sd:
        x = x + sd["transformer.wpe.weight"][:seqlen]
    x = x * options["mup_embeddings_scale"]
    pos = torch.arange(seqlen)
    bias = 0.0
    if "transformer.relative_pe.slopes" in sd:  # -slope * |i - j|
        distance = (pos.view(1, -1) - pos.view(-1, 1)).abs()
        bias = -sd["transformer.relative_pe.slopes"].view(HEADS, 1, 1) * distance
    causal = torch.ones(seqlen, seqlen, dtype=torch.bool).tril()
    scale_power = 1.0 if options["mup_scale_qk_dot_by_d"] else 0.5

    def linear(h, name):  # Conv1D
        return h @ sd[name + ".weight"] + sd[name + ".bias"]

    def layer_norm(h, name):
        return F.layer_norm(h, (HIDDEN,), sd[name + ".weight"], sd[name + ".bias"], eps=1e-5)

    for i in range(LAYERS):
        p = f"transformer.h.{i}."
        q, k, v = linear(layer_norm(x, p + "ln_1"), p + "attn.c_attn").split(HIDDEN, dim=-1)
        q, k, v = [t.view(*t.shape[:2], HEADS, head_dim).transpose(1, 2) for t in (q, k, v)]
        scores = q @ k.transpose(-1, -2) / head_dim ** scale_power + bias
        attn = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v
        x = x + linear(attn.transpose(1, 2).reshape(x.shape), p + "attn.c_proj")
        h = layer_norm(x, p + "ln_2")
        gated = linear(h, p + "mlp.c_fc") * F.silu(linear(h, p + "mlp.c_fc2"))
        x = x + linear(gated, p + "mlp.c_proj")
    x = layer_norm(x, "transformer.ln_f")
    return x @ sd["lm_head.weight"].T * (options["mup_output_alpha"] * options["mup_width_scale"])


def _to_published(ours, config):
    """Our state dict back under BTLM's names (the remap read backwards)."""
    out = {"transformer.wte.weight": ours["transformer.embeddings.word_embeddings.weight"],
           "lm_head.weight": ours["lm_head.weight"],
           "transformer.ln_f.weight": ours["transformer.ln_f.weight"],
           "transformer.ln_f.bias": ours["transformer.ln_f.bias"]}
    if "transformer.embeddings.position_embeddings.weight" in ours:
        out["transformer.wpe.weight"] = ours["transformer.embeddings.position_embeddings.weight"]
    for i in range(config.n_layer):
        p, q = f"transformer.h.{i}.", f"transformer.layers.{i}."
        c_fc, c_fc2 = ours[q + "mlp.fc1.weight"].chunk(2)
        b_fc, b_fc2 = ours[q + "mlp.fc1.bias"].chunk(2)
        out.update({
            p + "attn.c_attn.weight": ours[q + "mixer.Wqkv.weight"].t(),
            p + "attn.c_attn.bias": ours[q + "mixer.Wqkv.bias"],
            p + "attn.c_proj.weight": ours[q + "mixer.out_proj.weight"].t(),
            p + "attn.c_proj.bias": ours[q + "mixer.out_proj.bias"],
            p + "mlp.c_fc.weight": c_fc.t(), p + "mlp.c_fc.bias": b_fc,
            p + "mlp.c_fc2.weight": c_fc2.t(), p + "mlp.c_fc2.bias": b_fc2,
            p + "mlp.c_proj.weight": ours[q + "mlp.fc2.weight"].t(),
            p + "mlp.c_proj.bias": ours[q + "mlp.fc2.bias"]})
        for ln, norm in (("ln_1", "norm1"), ("ln_2", "norm2")):
            out[p + ln + ".weight"] = ours[q + norm + ".weight"]
            out[p + ln + ".bias"] = ours[q + norm + ".bias"]
    return out


def _ours(case):
    config = btlm_config_to_gpt2_config(_btlm_config(case))
    published = _published_checkpoint(case)
    model = GPTLMHeadModel(config).eval()
    model.load_state_dict(remap_state_dict_hf_btlm(dict(published), config))  # strict
    return model, config, published


@pytest.mark.parametrize("case", list(CASES))
def test_btlm_matches_published_architecture(case):
    model, config, published = _ours(case)
    assert config.use_alibi == (case == "alibi-mup")
    ids = torch.randint(0, VOCAB, (2, 19), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids).logits
    expected = _reference_logits(published, ids, case)
    assert expected.abs().max().item() > 1.0  # logits worth comparing
    assert (logits - expected).abs().max().item() <= 1e-4


@pytest.mark.parametrize("case", list(CASES))
def test_btlm_remap_roundtrip(case):
    model, config, published = _ours(case)
    back = _to_published(model.state_dict(), config)
    expected = {k: v for k, v in published.items()
                if not k.endswith((".attn.bias", ".attn.masked_bias", "relative_pe.slopes"))}
    assert set(back) == set(expected)
    for key, value in expected.items():
        assert torch.equal(back[key], value), key
    if "transformer.relative_pe.slopes" in published:  # the slopes the model derives instead
        slopes = torch.tensor(get_alibi_slopes(HEADS))
        assert torch.allclose(slopes, published["transformer.relative_pe.slopes"].flatten())


def test_btlm_unsupported_configs_raise():
    config = _btlm_config("alibi-mup")
    config.alibi_scaling = {"type": "linear", "factor": 2.0}
    with pytest.raises(NotImplementedError, match="alibi_scaling"):
        btlm_config_to_gpt2_config(config)
