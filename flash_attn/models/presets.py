"""Named GPT shapes for GPTLMHeadModel: GPT-2 small / medium / large / xl, a Llama-style model
(RMSNorm, SwiGLU, rotary, grouped-query attention, no biases, untied head) and a small GPT for
CPUs, as transformers GPT2Configs.

    config = gpt_config("gpt2-small", vocab_size=50257, seqlen=1024, fused=True)
    model = GPTLMHeadModel(config, device="cuda")

`fused=True` turns on every fused path the model has (flash attention, fused dense, FusedMLP
where the activation has one, fused dropout + add + norm); they need a CUDA GPU. Overrides
(n_layer=..., n_head_kv=..., dropout=...) replace the preset's values; a shape that cannot be
built raises ValueError naming the config fields.
"""

from transformers import GPT2Config

_LLAMA_STYLE = dict(rms_norm=True, activation_function="swiglu", rotary_emb_fraction=1.0,
                    rotary_emb_interleaved=False, qkv_proj_bias=False, out_proj_bias=False,
                    mlp_fc1_bias=False, mlp_fc2_bias=False, tie_word_embeddings=False)

PRESETS = {
    # A few minutes of training on two CPU cores (training/train.py's default there).
    "gpt-mini": dict(n_layer=4, n_embd=128, n_head=4),
    "gpt2-small": dict(n_layer=12, n_embd=768, n_head=12),
    "gpt2-medium": dict(n_layer=24, n_embd=1024, n_head=16),
    "gpt2-large": dict(n_layer=36, n_embd=1280, n_head=20),
    "gpt2-xl": dict(n_layer=48, n_embd=1600, n_head=25),
    # GPT-2 small's depth and width with Llama's blocks: 4 key/value heads for 12 query heads,
    # an MLP of 2048 gated units (about 8/3 x 768, as Llama sizes it).
    "llama-small": dict(n_layer=12, n_embd=768, n_head=12, n_head_kv=4, n_inner=2048,
                        **_LLAMA_STYLE),
}

# Flash attention's kernels take head dims up to 256.
MAX_FLASH_HEAD_DIM = 256


def fused_flags(sizes):
    """The flags that turn on every fused path a model of these sizes has."""
    activation = sizes.get("activation_function", "gelu_new")
    gated = activation in ("glu", "swiglu", "geglu")
    return dict(use_flash_attn=True, fused_bias_fc=True,
                # FusedMLP has the tanh GELU, ReLU and squared ReLU; gated MLPs have no fused form.
                fused_mlp=not gated and activation != "gelu",
                fused_dropout_add_ln=True, residual_in_fp32=True)


def gpt_config(preset, vocab_size, seqlen, fused=False, **overrides):
    """The GPT2Config of preset (a PRESETS name) with vocab_size tokens and sequences of up to
    seqlen (learned positions) or any length (rotary presets); overrides replace preset fields,
    `dropout` sets every dropout (default 0: pre-training)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; expected one of {', '.join(PRESETS)}")
    for name, value in (("vocab_size", vocab_size), ("seqlen", seqlen)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    sizes = dict(PRESETS[preset])
    dropout = overrides.pop("dropout", None)
    sizes.update({k: v for k, v in overrides.items() if v is not None})
    dropout = 0.0 if dropout is None else dropout
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {dropout}")
    _check_shape(sizes, fused)
    if fused:
        sizes.update(fused_flags(sizes))
    rotary = sizes.get("rotary_emb_fraction", 0.0) > 0
    return GPT2Config(vocab_size=vocab_size, n_positions=0 if rotary else seqlen,
                      resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                      # Multiples of 8 keep the head GEMM on tensor cores; the padded logits are
                      # never a target.
                      pad_vocab_size_multiple=8,
                      bos_token_id=None, eos_token_id=None, **sizes)


def _check_shape(sizes, fused):
    for name in ("n_layer", "n_embd", "n_head"):
        value = sizes[name]
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    n_embd, n_head = sizes["n_embd"], sizes["n_head"]
    if n_embd % n_head:
        raise ValueError(f"n_embd {n_embd} is not divisible by n_head {n_head}")
    n_head_kv = sizes.get("n_head_kv")
    if n_head_kv is not None and (n_head_kv < 1 or n_head % n_head_kv):
        raise ValueError(f"n_head {n_head} is not divisible by n_head_kv {n_head_kv} "
                         "(each key/value head serves a whole group of query heads)")
    head_dim = n_embd // n_head
    if sizes.get("rotary_emb_fraction", 0.0) > 0 and head_dim % 2:
        raise ValueError(f"head dim n_embd / n_head = {head_dim} must be even for rotary "
                         "embeddings")
    if fused and head_dim > MAX_FLASH_HEAD_DIM:
        raise ValueError(f"head dim n_embd / n_head = {head_dim} is over flash attention's "
                         f"{MAX_FLASH_HEAD_DIM}")


def training_flops_per_token(model, seqlen):
    """Forward + backward FLOPs per token of GPTLMHeadModel `model` on seqlen-token sequences:
    6 per weight the token is multiplied by (position embeddings, and the input embedding when
    the head is untied, are looked up, not multiplied) plus 6 x n_layer x n_embd x seqlen for
    attention's two products (PaLM's 12 x ..., halved by the causal mask). Call it on the
    model before it is sharded."""
    config = model.config
    tied = getattr(config, "tie_word_embeddings", True)
    multiplied = 0
    for name, p in model.named_parameters():  # a tied head is listed once, as the embedding
        if name.endswith("position_embeddings.weight"):
            continue
        if name.endswith("word_embeddings.weight") and not tied:
            continue
        multiplied += p.numel()
    return 6 * multiplied + 6 * config.n_layer * config.n_embd * seqlen
