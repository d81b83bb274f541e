import pytest
import torch
from transformers import BertConfig
from transformers import BertForPreTraining as HFBertForPreTraining
from transformers import BertModel as HFBertModel

from flash_attn.models.bert import (
    BertForPreTraining,
    BertModel,
    create_mixer_cls,
    create_mlp_cls,
    inv_remap_state_dict,
    remap_state_dict,
)
from flash_attn.modules.mha import MHA
from flash_attn.modules.mlp import Mlp, fused_mlp_cls

VOCAB = 100


def _bert_config(**kwargs):
    base = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=96,
                vocab_size=VOCAB, max_position_embeddings=64, hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0, initializer_range=0.1)
    base.update(kwargs)
    return BertConfig(**base)


def _batch(seed=0):
    torch.manual_seed(seed)
    ids = torch.randint(1, VOCAB, (3, 20))
    mask = torch.arange(20).unsqueeze(0) < torch.tensor([[20], [12], [5]])
    labels = torch.where(torch.rand(3, 20) < 0.3, ids, 0) * mask  # 0 = no prediction
    return ids, mask.long(), torch.randint(0, 2, (3, 20)), labels, torch.tensor([0, 1, 1])


@pytest.mark.parametrize("unpad", [False, True])
@pytest.mark.parametrize("options", [{}, {"hidden_act": "gelu_new", "pad_vocab_size_multiple": 8},
                                     {"dense_seq_output": True},
                                     {"dense_seq_output": True, "last_layer_subset": True}])
def test_bert_for_pretraining_matches_hf(unpad, options):
    config = _bert_config(**options)
    config.unpad = unpad
    torch.manual_seed(0)
    hf = HFBertForPreTraining(config).eval()
    ours = BertForPreTraining(config).eval()
    ours.load_state_dict(remap_state_dict(hf.state_dict(), config))
    ids, mask, token_types, labels, nsp = _batch()
    with torch.no_grad():
        expected = hf(ids, attention_mask=mask, token_type_ids=token_types,
                      labels=labels.masked_fill(labels == 0, -100), next_sentence_label=nsp)
        out = ours(ids, attention_mask=mask, token_type_ids=token_types, labels=labels,
                   next_sentence_label=nsp)
    logits = out.prediction_logits[..., :VOCAB]
    if options.get("dense_seq_output"):  # logits only where labels ask for a prediction
        expected_logits = expected.prediction_logits[labels > 0]
    else:
        # The unpadded path leaves padding rows at zero: compare the real tokens.
        logits, expected_logits = logits[mask.bool()], expected.prediction_logits[mask.bool()]
    assert (logits - expected_logits).abs().max().item() <= 1e-4
    assert (out.seq_relationship_logits - expected.seq_relationship_logits).abs().max().item() <= 1e-4
    assert abs(out.loss.item() - expected.loss.item()) <= 1e-5


def test_bert_model_matches_hf_and_unpadded_gradients():
    config = _bert_config()
    torch.manual_seed(0)
    hf = HFBertModel(config).eval()
    ours = BertModel(config).eval()
    ours.load_state_dict(remap_state_dict(hf.state_dict(), config))  # no "bert." prefix
    ids, mask, token_types, _, _ = _batch()
    expected = hf(ids, attention_mask=mask, token_type_ids=token_types)
    out = ours(ids, attention_mask=mask, token_type_ids=token_types)
    real = mask.bool()
    assert (out.last_hidden_state - expected.last_hidden_state)[real].abs().max().item() <= 1e-4
    assert (out.pooler_output - expected.pooler_output).abs().max().item() <= 1e-4
    # Padded and unpadded execution give the same gradients.
    config.unpad = True
    unpadded = BertModel(config)
    unpadded.load_state_dict(ours.state_dict())
    for model in (ours, unpadded):
        out = model(ids, attention_mask=mask, token_type_ids=token_types)
        (out.last_hidden_state[real].square().sum() + out.pooler_output.sum()).backward()
    for (name, p), q in zip(ours.named_parameters(), unpadded.parameters()):
        assert (p.grad - q.grad).abs().max().item() <= 1e-4, name


@pytest.mark.parametrize("last_layer_subset", [False, True])
def test_bert_inverse_remap_roundtrip(last_layer_subset):
    config = _bert_config(pad_vocab_size_multiple=8, last_layer_subset=last_layer_subset,
                          dense_seq_output=True)
    torch.manual_seed(0)
    hf = HFBertForPreTraining(config)
    ours = BertForPreTraining(config)
    ours.load_state_dict(remap_state_dict(hf.state_dict(), config))
    back = inv_remap_state_dict(ours.state_dict(), config)
    reference = hf.state_dict()
    missing = set(reference) - set(back)
    assert all(k.endswith("position_ids") for k in missing), missing
    for key in back:
        assert torch.equal(back[key], reference[key]), key


def test_bert_create_mixer_and_mlp_cls():
    config = _bert_config(hidden_act="gelu_new")
    mixer = create_mixer_cls(config)(64)
    assert isinstance(mixer, MHA) and not mixer.causal and not mixer.cross_attn
    assert mixer.num_heads == 4 and mixer.rotary_emb_dim == 0
    assert create_mixer_cls(config, cross_attn=True)(64).cross_attn
    rotary = _bert_config(position_embedding_type="rotary")
    rotary.rotary_emb_dim = 8
    assert create_mixer_cls(rotary)(64).rotary_emb_dim == 8

    torch.manual_seed(0)
    mlp = create_mlp_cls(config, return_residual=True)(64)
    assert type(mlp) is Mlp and mlp.fc1.out_features == 96
    x = torch.randn(3, 64)
    out, residual = mlp(x)
    expected = mlp.fc2(torch.nn.functional.gelu(mlp.fc1(x), approximate="tanh"))
    assert residual is x and torch.allclose(out, expected)
    # fused_mlp: FusedMLP for the tanh gelu when it is importable; the plain Mlp for erf gelu.
    config.fused_mlp = True
    if fused_mlp_cls() is not None:
        assert type(create_mlp_cls(config)(64)) is fused_mlp_cls()
    erf = _bert_config(hidden_act="gelu")
    erf.fused_mlp = True
    assert type(create_mlp_cls(erf)(64)) is Mlp


@pytest.mark.gpu
def test_bert_flash_unpadded_matches_reference_gpu():
    config = _bert_config(hidden_size=256, intermediate_size=1024, vocab_size=1000,
                          max_position_embeddings=512, initializer_range=0.02)
    torch.manual_seed(0)
    ref = BertForPreTraining(config).cuda().eval()
    ref_lowp = BertForPreTraining(config).cuda().to(torch.bfloat16).eval()
    ref_lowp.load_state_dict(ref.state_dict())
    config.update(dict(use_flash_attn=True, fused_bias_fc=True, fused_dropout_add_ln=True))
    flash = BertForPreTraining(config).cuda().to(torch.bfloat16).eval()
    assert flash.bert.encoder.unpad
    flash.load_state_dict(ref.state_dict())
    ids = torch.randint(1, 1000, (4, 256), device="cuda")
    mask = torch.arange(256, device="cuda") < torch.tensor([[256], [200], [17], [1]], device="cuda")
    with torch.no_grad():
        expected = ref(ids, attention_mask=mask).prediction_logits[mask]
        base = (ref_lowp(ids, attention_mask=mask).prediction_logits[mask].float() - expected)
        err = flash(ids, attention_mask=mask).prediction_logits[mask].float() - expected
    # flash-attn's model-test bound: 3x the error of the plain path in bf16.
    assert err.abs().max().item() <= 3 * base.abs().max().item() + 1e-3
