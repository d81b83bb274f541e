"""Vision Transformer (timm's layout and parameter names): patch embeddings + class token +
learned positions, pre-norm blocks, final norm, linear head.

With global_pool="token" only the class token is needed after the last block, so the last block's
attention is a cross-attention from that one token to all tokens (Wq + Wkv instead of Wqkv);
load_state_dict splits a checkpoint's Wqkv accordingly. remap_state_dict_hf_vit maps HF
transformers' ViTModel / ViTForImageClassification weights.
"""

import re
from collections import OrderedDict
from functools import partial

import torch
import torch.nn as nn
from einops import rearrange

from flash_attn.layers.patch_embed import PatchEmbed
from flash_attn.modules.block import Block, DropPath, _norm_eps, fused_add_norm_fn
from flash_attn.modules.mha import MHA, warn_fallback
from flash_attn.modules.mlp import Mlp, fused_mlp_cls


def create_mixer_cls(num_heads, qkv_bias, attn_drop, use_flash_attn, fused_bias_fc,
                     cross_attn=False):
    return partial(MHA, num_heads=num_heads, cross_attn=cross_attn, qkv_proj_bias=qkv_bias,
                   dropout=attn_drop, fused_bias_fc=fused_bias_fc, use_flash_attn=use_flash_attn)


def create_mlp_cls(embed_dim, mlp_ratio, act_layer, fused_mlp):
    """Mlp with act_layer() (an nn.Module class such as nn.GELU); fused_mlp: FusedMLP, whose
    gelu is the tanh approximation (a warning and the plain Mlp when it is unavailable)."""
    hidden_features = int(embed_dim * mlp_ratio)
    if fused_mlp:
        if fused_mlp_cls() is not None:
            return partial(fused_mlp_cls(), hidden_features=hidden_features)
        warn_fallback("fused_mlp", "flash_attn.ops.fused_dense.FusedMLP is unavailable")
    return partial(Mlp, hidden_features=hidden_features, activation=act_layer())


def create_block(embed_dim, num_heads, mlp_ratio, qkv_bias, drop_rate, attn_drop_rate,
                 drop_path1, drop_path2, norm_layer, act_layer, use_flash_attn, fused_bias_fc,
                 fused_mlp, fused_dropout_add_ln, layer_idx=None, n_layer=None,
                 last_layer_subset=False):
    cross_attn = last_layer_subset and layer_idx == n_layer - 1
    mixer_cls = create_mixer_cls(num_heads, qkv_bias, attn_drop_rate, use_flash_attn,
                                 fused_bias_fc, cross_attn=cross_attn)
    mlp_cls = create_mlp_cls(embed_dim, mlp_ratio, act_layer, fused_mlp)
    return Block(embed_dim, mixer_cls, mlp_cls, norm_cls=norm_layer, prenorm=True,
                 resid_dropout1=drop_rate, resid_dropout2=drop_rate, drop_path1=drop_path1,
                 drop_path2=drop_path2, fused_dropout_add_ln=fused_dropout_add_ln)


class VisionTransformer(nn.Module):
    def __init__(self, img_size=224, patch_size=16, in_chans=3, num_classes=1000,
                 global_pool="token", embed_dim=768, depth=12, num_heads=12, mlp_ratio=4.0,
                 qkv_bias=True, init_values=None, class_token=True, no_embed_class=False,
                 pre_norm=False, fc_norm=None, drop_rate=0.0, attn_drop_rate=0.0,
                 drop_path_rate=0.0, weight_init="", embed_layer=PatchEmbed, norm_layer=None,
                 act_layer=None, use_flash_attn=False, fused_bias_fc=False, fused_mlp=False,
                 fused_dropout_add_ln=False):
        super().__init__()
        unsupported = {"global_pool": global_pool != "token", "init_values": init_values is not None,
                       "class_token": not class_token, "pre_norm": pre_norm,
                       "fc_norm": fc_norm not in (None, False)}
        bad = [name for name, is_bad in unsupported.items() if is_bad]
        if bad:
            raise NotImplementedError(f"VisionTransformer: unsupported options {bad}")
        norm_layer = norm_layer or partial(nn.LayerNorm, eps=1e-6)
        act_layer = act_layer or nn.GELU
        self.global_pool, self.num_classes = global_pool, num_classes
        self.num_features = self.embed_dim = embed_dim
        self.num_prefix_tokens, self.no_embed_class = 1, no_embed_class
        extra = {"fused_bias_fc": fused_bias_fc} if embed_layer is PatchEmbed else {}
        self.patch_embed = embed_layer(img_size=img_size, patch_size=patch_size,
                                       in_chans=in_chans, embed_dim=embed_dim, **extra)
        num_patches = self.patch_embed.num_patches
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        embed_len = num_patches if no_embed_class else num_patches + 1
        self.pos_embed = nn.Parameter(torch.randn(1, embed_len, embed_dim) * 0.02)

        # Pre-norm blocks add the previous block's MLP output at their start: block i's
        # drop_path1 belongs to block i - 1's MLP, and the last MLP's is self.drop_path.
        dpr = [x.item() for x in torch.linspace(0, drop_path_rate, depth)]
        self.blocks = nn.ModuleList([
            create_block(embed_dim, num_heads, mlp_ratio, qkv_bias, drop_rate, attn_drop_rate,
                         drop_path1=dpr[i - 1] if i > 0 else 0.0, drop_path2=dpr[i],
                         norm_layer=norm_layer, act_layer=act_layer,
                         use_flash_attn=use_flash_attn, fused_bias_fc=fused_bias_fc,
                         fused_mlp=fused_mlp, fused_dropout_add_ln=fused_dropout_add_ln,
                         layer_idx=i, n_layer=depth, last_layer_subset=(global_pool == "token"))
            for i in range(depth)])
        self.dropout = nn.Dropout(p=drop_rate)
        self.drop_path = DropPath(p=dpr[-1])
        self.norm = norm_layer(embed_dim)
        self.layer_norm_fn = fused_add_norm_fn(fused_dropout_add_ln)
        self.head = nn.Linear(self.embed_dim, num_classes) if num_classes > 0 else nn.Identity()
        self.init_weights(weight_init)

    def init_weights(self, mode=""):
        if mode not in ("", "jax"):
            raise ValueError(f"weight_init {mode!r} is not supported")
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.normal_(self.cls_token, std=1e-6)
        for name, module in self.named_modules():
            if module is not self:  # the root's init_weights is this method
                init_weights_vit_timm(module, name)
        if mode == "jax" and isinstance(self.head, nn.Linear):
            nn.init.zeros_(self.head.weight)

    def _init_weights(self, module):
        init_weights_vit_timm(module)

    @torch.jit.ignore
    def no_weight_decay(self):
        return {"pos_embed", "cls_token"}

    def _pos_embed(self, x):
        cls = self.cls_token.expand(x.shape[0], -1, -1)
        if self.no_embed_class:
            return torch.cat((cls, x + self.pos_embed), dim=1)
        return torch.cat((cls, x), dim=1) + self.pos_embed

    def forward_features(self, x, all_tokens=True):
        """Images (b, c, H, W) -> normalised tokens (b, 1 + num_patches, d); only the class
        token (b, 1, d) when all_tokens=False and global_pool == "token"."""
        hidden_states = self._pos_embed(self.patch_embed(x))
        residual = None
        subset_last = self.global_pool == "token" and not all_tokens
        for i, block in enumerate(self.blocks):
            last = i == len(self.blocks) - 1
            if last and self.blocks[-1].mixer.cross_attn:
                # Cross-attention layer: queries from the selected tokens, keys from all.
                subset = slice(0, 1) if subset_last else slice(None)
                hidden_states, residual = block(hidden_states, residual, mixer_subset=subset)
            else:
                hidden_states, residual = block(hidden_states, residual)
        if self.layer_norm_fn is not None:
            rowscale = None
            if self.training and self.drop_path.p > 0.0:
                rowscale = self.drop_path(hidden_states.new_ones(hidden_states.shape[:-1]))
            return self.layer_norm_fn(hidden_states, self.norm.weight, self.norm.bias,
                                      residual=residual, eps=_norm_eps(self.norm, hidden_states.dtype),
                                      dropout_p=self.dropout.p if self.training else 0.0,
                                      rowscale=rowscale, prenorm=False)
        residual = self.drop_path(self.dropout(hidden_states)) + residual
        return self.norm(residual.to(dtype=self.norm.weight.dtype))

    def forward_head(self, x, pre_logits=False):
        x = x[:, 0]
        return x if pre_logits else self.head(x)

    def forward(self, x):
        return self.forward_head(self.forward_features(x, all_tokens=False))

    def load_state_dict(self, state_dict, strict=True, **kwargs):
        """Also takes timm's names (attn.qkv, attn.proj) and a Conv2d patch projection."""
        state_dict = OrderedDict(state_dict)
        weight = state_dict.get("patch_embed.proj.weight")
        if weight is not None and weight.dim() == 4:
            state_dict["patch_embed.proj.weight"] = rearrange(weight, "o c h w -> o (c h w)")
        renamed = OrderedDict()
        for key, value in state_dict.items():
            key = re.sub(r"^blocks\.(\d+)\.attn\.qkv\.", r"blocks.\1.mixer.Wqkv.", key)
            key = re.sub(r"^blocks\.(\d+)\.attn\.proj\.", r"blocks.\1.mixer.out_proj.", key)
            renamed[key] = value
        last = f"blocks.{len(self.blocks) - 1}.mixer"
        if self.blocks[-1].mixer.cross_attn:
            for param in ("weight", "bias"):
                wqkv = renamed.pop(f"{last}.Wqkv.{param}", None)
                if wqkv is not None:
                    renamed[f"{last}.Wq.{param}"] = wqkv[: self.embed_dim]
                    renamed[f"{last}.Wkv.{param}"] = wqkv[self.embed_dim:]
        return super().load_state_dict(renamed, strict=strict, **kwargs)


def init_weights_vit_timm(module, name=""):
    """timm's original ViT init for one module: truncated N(0, 0.02) linear weights, zero
    biases; a module with its own init_weights() runs it. (name: for timm's named_apply.)"""
    if isinstance(module, nn.Linear):
        nn.init.trunc_normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif hasattr(module, "init_weights"):
        module.init_weights()


def vit_base_patch16_224(pretrained=False, **kwargs):
    """ViT-B/16 (86M parameters) at 224 x 224: embed 768, depth 12, 12 heads."""
    if pretrained:
        raise NotImplementedError("vit_base_patch16_224: load weights with "
                                  "utils.pretrained.state_dict_from_pretrained + load_state_dict")
    return VisionTransformer(**dict(dict(patch_size=16, embed_dim=768, depth=12, num_heads=12),
                                    **kwargs))


def remap_state_dict_hf_vit(state_dict, config=None):
    """HF transformers ViTModel / ViTForImageClassification state dict -> VisionTransformer's
    (both the "encoder.layer.N.attention.attention.query" naming and the newer
    "layers.N.attention.q_proj" one). The pooler has no counterpart and is dropped."""
    layer_names = [
        (r"(?:encoder\.layer|layers)\.(\d+)\.layernorm_before\.", r"blocks.\1.norm1."),
        (r"(?:encoder\.layer|layers)\.(\d+)\.layernorm_after\.", r"blocks.\1.norm2."),
        (r"encoder\.layer\.(\d+)\.attention\.output\.dense\.", r"blocks.\1.mixer.out_proj."),
        (r"layers\.(\d+)\.attention\.o_proj\.", r"blocks.\1.mixer.out_proj."),
        (r"encoder\.layer\.(\d+)\.intermediate\.dense\.", r"blocks.\1.mlp.fc1."),
        (r"encoder\.layer\.(\d+)\.output\.dense\.", r"blocks.\1.mlp.fc2."),
        (r"layers\.(\d+)\.mlp\.(fc\d)\.", r"blocks.\1.mlp.\2."),
    ]
    qkv_names = {"query": 0, "key": 1, "value": 2, "q_proj": 0, "k_proj": 1, "v_proj": 2}
    out, qkv = OrderedDict(), {}
    for key, value in state_dict.items():
        key = re.sub(r"^vit\.", "", key)
        if key.startswith("pooler."):
            continue
        m = re.match(r"(?:encoder\.layer|layers)\.(\d+)\.attention\.(?:attention\.)?"
                     r"(query|key|value|q_proj|k_proj|v_proj)\.(weight|bias)$", key)
        if m:
            i, name, param = m.groups()
            qkv[(int(i), param, qkv_names[name])] = value
            continue
        if key == "embeddings.cls_token":
            key = "cls_token"
        elif key == "embeddings.position_embeddings":
            key = "pos_embed"
        elif key.startswith("embeddings.patch_embeddings.projection."):
            key = key.replace("embeddings.patch_embeddings.projection.", "patch_embed.proj.")
            if value.dim() == 4:
                value = rearrange(value, "o c h w -> o (c h w)")
        elif key.startswith("layernorm."):
            key = key.replace("layernorm.", "norm.")
        elif key.startswith("classifier."):
            key = key.replace("classifier.", "head.")
        else:
            for pattern, repl in layer_names:
                key = re.sub("^" + pattern, repl, key)
        out[key] = value
    for i, param in sorted({(i, p) for i, p, _ in qkv}):
        out[f"blocks.{i}.mixer.Wqkv.{param}"] = torch.cat([qkv[(i, param, j)] for j in range(3)])
    return out

