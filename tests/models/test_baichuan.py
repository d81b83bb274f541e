"""Baichuan (remote code; no transformers class): a synthetic checkpoint with the published key
names, remapped onto GPTLMHeadModel, against a plain PyTorch reading of the published model
(W_pack [q; k; v], RMSNorm, SwiGLU; rotary for 7B, ALiBi for 13B; Baichuan 2's NormHead)."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from transformers import PretrainedConfig

from flash_attn.models.baichuan import baichuan_config_to_gpt2_config, remap_state_dict_hf_baichuan
from flash_attn.models.gpt import GPTLMHeadModel

VOCAB, LAYERS, HIDDEN, INTERMEDIATE = 100, 2, 48, 80


def _baichuan_config(n_head):
    return PretrainedConfig(
        model_type="baichuan", vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS, num_attention_heads=n_head, hidden_act="silu", rms_norm_eps=1e-6,
        initializer_range=0.02, bos_token_id=0, eos_token_id=1, pad_token_id=0,
        tie_word_embeddings=False)


def _published_checkpoint(n_head, rotary, seed=0):
    """Random weights under Baichuan's key names (nn.Linear: (out, in))."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.2):
        return torch.randn(*shape, generator=gen) * scale

    sd = {"model.embed_tokens.weight": rand(VOCAB, HIDDEN, scale=1.0),
          "model.norm.weight": 1 + rand(HIDDEN), "lm_head.weight": rand(VOCAB, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        sd.update({p + "input_layernorm.weight": 1 + rand(HIDDEN),
                   p + "post_attention_layernorm.weight": 1 + rand(HIDDEN),
                   p + "self_attn.W_pack.weight": rand(3 * HIDDEN, HIDDEN),
                   p + "self_attn.o_proj.weight": rand(HIDDEN, HIDDEN),
                   p + "mlp.gate_proj.weight": rand(INTERMEDIATE, HIDDEN),
                   p + "mlp.up_proj.weight": rand(INTERMEDIATE, HIDDEN),
                   p + "mlp.down_proj.weight": rand(HIDDEN, INTERMEDIATE)})
        if rotary:  # Baichuan-7B stores its rotary frequencies
            sd[p + "self_attn.rotary_emb.inv_freq"] = torch.ones(HIDDEN // n_head // 2)
    return sd


def _alibi_slopes(n):
    """The ALiBi paper's slopes (Baichuan-13B's _get_interleave)."""
    if math.log2(n).is_integer():
        return [2 ** (-8 * (i + 1) / n) for i in range(n)]
    lower = 2 ** math.floor(math.log2(n))
    return _alibi_slopes(lower) + _alibi_slopes(2 * lower)[0::2][: n - lower]


def _rms_norm(x, weight, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def _reference_logits(sd, ids, n_head, rotary, norm_head):
    """Baichuan's published forward, read plainly."""
    seqlen, head_dim = ids.shape[1], HIDDEN // n_head
    x = sd["model.embed_tokens.weight"][ids]
    pos = torch.arange(seqlen, dtype=torch.float32)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    freqs = torch.cat([torch.outer(pos, inv_freq)] * 2, dim=-1)  # (s, head_dim)
    causal = torch.ones(seqlen, seqlen, dtype=torch.bool).tril()
    # Baichuan-13B adds slope * (key position) and masks the future: per query row this differs
    # from -slope * |i - j| by a constant, which softmax ignores.
    alibi = torch.tensor(_alibi_slopes(n_head)).view(n_head, 1, 1) * pos.view(1, 1, seqlen)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        h = _rms_norm(x, sd[p + "input_layernorm.weight"])
        q, k, v = (h @ sd[p + "self_attn.W_pack.weight"].T).chunk(3, dim=-1)
        q, k, v = [t.view(*t.shape[:2], n_head, head_dim).transpose(1, 2) for t in (q, k, v)]
        if rotary:
            q = q * freqs.cos() + _rotate_half(q) * freqs.sin()
            k = k * freqs.cos() + _rotate_half(k) * freqs.sin()
        scores = q @ k.transpose(-1, -2) / math.sqrt(head_dim)
        if not rotary:
            scores = scores + alibi
        attn = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v
        x = x + attn.transpose(1, 2).reshape(x.shape) @ sd[p + "self_attn.o_proj.weight"].T
        h = _rms_norm(x, sd[p + "post_attention_layernorm.weight"])
        gated = F.silu(h @ sd[p + "mlp.gate_proj.weight"].T) * (h @ sd[p + "mlp.up_proj.weight"].T)
        x = x + gated @ sd[p + "mlp.down_proj.weight"].T
    x = _rms_norm(x, sd["model.norm.weight"])
    head = sd["lm_head.weight"]
    if norm_head:
        head = head / head.norm(dim=1, keepdim=True)
    return x @ head.T


def _to_published(ours, config):
    """Our state dict back under Baichuan's names (the remap read backwards)."""
    out = {"model.embed_tokens.weight": ours["transformer.embeddings.word_embeddings.weight"],
           "model.norm.weight": ours["transformer.ln_f.weight"],
           "lm_head.weight": ours["lm_head.weight"]}
    for i in range(config.n_layer):
        p, q = f"model.layers.{i}.", f"transformer.layers.{i}."
        up, gate = ours[q + "mlp.fc1.weight"].chunk(2)
        out.update({p + "input_layernorm.weight": ours[q + "norm1.weight"],
                    p + "post_attention_layernorm.weight": ours[q + "norm2.weight"],
                    p + "self_attn.W_pack.weight": ours[q + "mixer.Wqkv.weight"],
                    p + "self_attn.o_proj.weight": ours[q + "mixer.out_proj.weight"],
                    p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
                    p + "mlp.down_proj.weight": ours[q + "mlp.fc2.weight"]})
    return out


CASES = {"7b-rotary": dict(n_head=4, rotary=True, norm_head=False),
         "13b-alibi": dict(n_head=6, rotary=False, norm_head=False),  # 6: not a power of two
         "baichuan2-13b-alibi-normhead": dict(n_head=4, rotary=False, norm_head=True)}


def _ours(case):
    n_head, rotary = CASES[case]["n_head"], CASES[case]["rotary"]
    config = baichuan_config_to_gpt2_config(_baichuan_config(n_head), use_alibi=not rotary,
                                            norm_head=CASES[case]["norm_head"])
    published = _published_checkpoint(n_head, rotary)
    model = GPTLMHeadModel(config).eval()
    model.load_state_dict(remap_state_dict_hf_baichuan(dict(published), config))  # strict
    return model, config, published


@pytest.mark.parametrize("case", list(CASES))
def test_baichuan_matches_published_architecture(case):
    model, _, published = _ours(case)
    ids = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids).logits
    expected = _reference_logits(published, ids, **CASES[case])
    assert expected.abs().max().item() > 1.0  # logits worth comparing
    assert (logits - expected).abs().max().item() <= 1e-4


@pytest.mark.parametrize("case", ["7b-rotary", "13b-alibi"])
def test_baichuan_remap_roundtrip(case):
    model, config, published = _ours(case)
    back = _to_published(model.state_dict(), config)
    expected = {k: v for k, v in published.items() if not k.endswith("inv_freq")}
    assert set(back) == set(expected)
    for key, value in expected.items():
        assert torch.equal(back[key], value), key


def test_baichuan_config_follows_the_released_sizes():
    def sized(hidden_size, vocab_size):
        c = _baichuan_config(n_head=40)
        c.hidden_size, c.vocab_size = hidden_size, vocab_size
        return baichuan_config_to_gpt2_config(c)

    for hidden, vocab, alibi, norm_head in [(4096, 64000, False, False),   # Baichuan-7B
                                            (5120, 64000, True, False),    # Baichuan-13B
                                            (4096, 125696, False, True),   # Baichuan2-7B
                                            (5120, 125696, True, True)]:   # Baichuan2-13B
        config = sized(hidden, vocab)
        assert (config.use_alibi, config.norm_head) == (alibi, norm_head)
        assert config.rotary_emb_fraction == (0.0 if alibi else 1.0)


def test_baichuan_from_pretrained_reads_model_type(tmp_path):
    from safetensors.torch import save_file

    model, config, published = _ours("7b-rotary")
    save_file(published, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "baichuan"}))
    loaded = GPTLMHeadModel.from_pretrained(str(tmp_path), config).eval()
    ids = torch.randint(0, VOCAB, (1, 9))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
