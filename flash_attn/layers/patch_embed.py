"""Image to patch embeddings: split an image into patch_size x patch_size patches and project
each one with a linear layer (the same map as a stride-patch_size convolution, as a GEMM)."""

import torch.nn as nn
from einops import rearrange


def _pair(x):
    return tuple(x) if isinstance(x, (tuple, list)) else (x, x)


class PatchEmbed(nn.Module):
    """(b, c, H, W) -> (b, num_patches, embed_dim), or (b, H/p, W/p, embed_dim) with
    flatten=False. proj.weight is (embed_dim, c * p * p), laid out (c, p_h, p_w) like a conv
    kernel flattened: a Conv2d checkpoint maps over with weight.flatten(1)."""

    def __init__(self, img_size=224, patch_size=16, in_chans=3, embed_dim=768, norm_layer=None,
                 flatten=True, bias=True, fused_bias_fc=False):
        super().__init__()
        from flash_attn.modules.mha import dense_classes

        self.img_size, self.patch_size = _pair(img_size), _pair(patch_size)
        self.grid_size = (self.img_size[0] // self.patch_size[0],
                          self.img_size[1] // self.patch_size[1])
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        self.flatten = flatten
        linear_cls, _ = dense_classes(fused_bias_fc)
        self.proj = linear_cls(in_chans * self.patch_size[0] * self.patch_size[1], embed_dim,
                               bias=bias)
        self.norm = norm_layer(embed_dim) if norm_layer else nn.Identity()

    def forward(self, x):
        _, _, height, width = x.shape
        if (height, width) != self.img_size:
            raise ValueError(f"PatchEmbed: image size {(height, width)} != the model's "
                             f"{self.img_size}")
        x = rearrange(x, "b c (h p1) (w p2) -> b h w (c p1 p2)", p1=self.patch_size[0],
                      p2=self.patch_size[1])
        x = self.proj(x)
        if self.flatten:
            x = rearrange(x, "b h w d -> b (h w) d")
        return self.norm(x)
