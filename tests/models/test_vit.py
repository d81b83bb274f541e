import pytest
import torch
from transformers import ViTConfig, ViTForImageClassification

from flash_attn.layers.patch_embed import PatchEmbed
from flash_attn.models.vit import (
    VisionTransformer,
    create_mixer_cls,
    create_mlp_cls,
    init_weights_vit_timm,
    remap_state_dict_hf_vit,
    vit_base_patch16_224,
)
from flash_attn.modules.mha import MHA
from flash_attn.modules.mlp import Mlp


def test_patch_embed_matches_conv():
    torch.manual_seed(0)
    embed = PatchEmbed(img_size=16, patch_size=4, in_chans=3, embed_dim=8)
    conv = torch.nn.Conv2d(3, 8, kernel_size=4, stride=4)
    with torch.no_grad():
        conv.weight.copy_(embed.proj.weight.view(8, 3, 4, 4))
        conv.bias.copy_(embed.proj.bias)
    x = torch.randn(2, 3, 16, 16)
    expected = conv(x).flatten(2).transpose(1, 2)
    assert embed(x).shape == (2, 16, 8)
    assert (embed(x) - expected).abs().max().item() < 1e-5


def _hf_and_ours():
    config = ViTConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                       intermediate_size=128, image_size=32, patch_size=8, layer_norm_eps=1e-6,
                       num_labels=10)
    torch.manual_seed(0)
    hf = ViTForImageClassification(config).eval()
    ours = VisionTransformer(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4,
                             mlp_ratio=2.0, num_classes=10).eval()
    ours.load_state_dict(remap_state_dict_hf_vit(hf.state_dict()))
    return hf, ours


def test_vit_matches_hf():
    hf, ours = _hf_and_ours()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        features = hf.vit(x).last_hidden_state
        assert (ours.forward_features(x) - features).abs().max().item() <= 1e-4
        # The class-token-only last layer (cross-attention) gives the same logits.
        assert (ours(x) - hf(x).logits).abs().max().item() <= 1e-4


def test_vit_loads_timm_names_and_base_config():
    _, ours = _hf_and_ours()
    timm_style = {}
    for key, value in ours.state_dict().items():
        key = key.replace("mixer.Wqkv", "attn.qkv").replace("mixer.out_proj", "attn.proj")
        timm_style[key] = value
    last = "blocks.1.mixer"
    timm_style["blocks.1.attn.qkv.weight"] = torch.cat([timm_style.pop(f"{last}.Wq.weight"),
                                                        timm_style.pop(f"{last}.Wkv.weight")])
    timm_style["blocks.1.attn.qkv.bias"] = torch.cat([timm_style.pop(f"{last}.Wq.bias"),
                                                      timm_style.pop(f"{last}.Wkv.bias")])
    timm_style["patch_embed.proj.weight"] = timm_style["patch_embed.proj.weight"].view(64, 3, 8, 8)
    fresh = VisionTransformer(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4,
                              mlp_ratio=2.0, num_classes=10).eval()
    fresh.load_state_dict(timm_style)
    x = torch.randn(1, 3, 32, 32)
    assert torch.equal(fresh(x), ours(x))
    model = vit_base_patch16_224(depth=1)
    assert model.patch_embed.num_patches == 196 and model.head.out_features == 1000


def test_vit_create_mixer_and_mlp_cls():
    mixer = create_mixer_cls(4, qkv_bias=False, attn_drop=0.0, use_flash_attn=False,
                             fused_bias_fc=False, cross_attn=True)(64)
    assert isinstance(mixer, MHA) and mixer.cross_attn and mixer.num_heads == 4
    assert mixer.Wq.bias is None and mixer.Wkv.bias is None
    mlp = create_mlp_cls(64, mlp_ratio=2.5, act_layer=torch.nn.GELU, fused_mlp=False)(64)
    assert type(mlp) is Mlp and mlp.fc1.out_features == 160
    assert isinstance(mlp.activation, torch.nn.GELU)


def test_init_weights_vit_timm():
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 256)
    torch.nn.init.ones_(linear.bias)
    init_weights_vit_timm(linear)
    assert not linear.bias.any() and abs(linear.weight.std().item() - 0.02) < 1e-3

    class OwnInit(torch.nn.Module):
        def init_weights(self):
            self.called = True

    module = OwnInit()
    init_weights_vit_timm(module, "blocks.0")
    assert module.called
    # The model's own init: every linear layer as above; weight_init="jax" zeroes the head.
    model = VisionTransformer(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4,
                              num_classes=10, weight_init="jax")
    assert not model.head.weight.any() and not model.blocks[0].mlp.fc1.bias.any()
    assert 0.01 < model.blocks[0].mlp.fc1.weight.std().item() < 0.03


@pytest.mark.gpu
def test_vit_flash_matches_reference_gpu():
    torch.manual_seed(0)
    kwargs = dict(depth=2, num_classes=10)
    ref = vit_base_patch16_224(**kwargs).cuda().eval()
    ref_lowp = vit_base_patch16_224(**kwargs).cuda().to(torch.bfloat16).eval()
    ref_lowp.load_state_dict(ref.state_dict())
    flash = vit_base_patch16_224(use_flash_attn=True, fused_bias_fc=True, fused_dropout_add_ln=True,
                                 **kwargs).cuda().to(torch.bfloat16).eval()
    flash.load_state_dict(ref.state_dict())
    x = torch.randn(4, 3, 224, 224, device="cuda")
    with torch.no_grad():
        expected = ref.forward_features(x)
        base = (ref_lowp.forward_features(x.bfloat16()).float() - expected).abs().max().item()
        err = (flash.forward_features(x.bfloat16()).float() - expected).abs().max().item()
    # flash-attn's model-test bound: 3x the error of the plain path in bf16.
    assert err <= 3 * base + 1e-3, (err, base)
