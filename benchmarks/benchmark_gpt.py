"""GPT-2 training step, tokens/s: our GPTLMHeadModel with every fused path that works on this
machine vs HF transformers' GPT2LMHeadModel (attn_implementation="sdpa"), measured in one run.

Both: GPT-2 config (dropout 0.1), fp32 weights, bf16 autocast, seq 1024, torch.optim.AdamW
(fused=True); GPT-2 small at batch 16, medium at batch 8. Ours pads the vocabulary to a multiple
of 8 (50264, a flash-attn training option) and uses flash_attn's Triton cross-entropy when it
works. Each fused piece is tried on a small input first (forward and backward under autocast);
one that fails is switched off and the reason printed.

    python benchmarks/benchmark_gpt.py
"""

import math
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import environment, report, save_plot  # noqa: E402

SEQLEN = 1024
MODELS = [("gpt2-small", dict(n_layer=12, n_embd=768, n_head=12), 16),
          ("gpt2-medium", dict(n_layer=24, n_embd=1024, n_head=16), 8)]
WARMUP, STEPS = 3, 10
DEVICE = "cuda"


# ----------------------------------------------------------------------------------------------
# Which fused paths work here.
# ----------------------------------------------------------------------------------------------


def _autocast():
    return torch.autocast("cuda", dtype=torch.bfloat16)


def _probe_flash_attn():
    from flash_attn import flash_attn_qkvpacked_func

    qkv = torch.randn(2, 128, 3, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    flash_attn_qkvpacked_func(qkv, dropout_p=0.1, causal=True).sum().backward()


def _probe_fused_dense():
    from flash_attn.ops.fused_dense import FusedDense

    layer = FusedDense(256, 256, device="cuda")
    x = torch.randn(128, 256, device="cuda", requires_grad=True)
    with _autocast():
        y = layer(x)
    y.float().sum().backward()


def _probe_fused_mlp():
    from flash_attn.ops.fused_dense import FusedMLP

    mlp = FusedMLP(256, 1024, activation="gelu_approx", device="cuda")
    x = torch.randn(128, 256, device="cuda", requires_grad=True)
    with _autocast():
        y = mlp(x)
    y.float().sum().backward()


def _probe_dropout_add_ln():
    from flash_attn.ops.triton.layer_norm import layer_norm_fn

    norm = torch.nn.LayerNorm(256, device="cuda")
    x = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    residual = torch.randn(128, 256, device="cuda", requires_grad=True)
    with _autocast():
        out, res = layer_norm_fn(x, norm.weight, norm.bias, residual=residual, eps=1e-5,
                                 dropout_p=0.1, prenorm=True, residual_in_fp32=True)
    (out.float().sum() + res.float().sum()).backward()


def _probe_cross_entropy():
    from flash_attn.losses.cross_entropy import CrossEntropyLoss

    logits = torch.randn(64, 50264, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 50257, (64,), device="cuda")
    CrossEntropyLoss(inplace_backward=True)(logits, labels).backward()


PROBES = {
    "use_flash_attn": _probe_flash_attn,
    "fused_bias_fc": _probe_fused_dense,
    "fused_mlp": _probe_fused_mlp,
    "fused_dropout_add_ln": _probe_dropout_add_ln,
    "triton cross_entropy": _probe_cross_entropy,
}


def available_paths():
    """{flag: (works, note)} from running each piece once."""
    found = {}
    for flag, probe in PROBES.items():
        try:
            probe()
            torch.cuda.synchronize()
            found[flag] = (True, "ok")
        except Exception as error:  # missing extension, kernel not built, wrong result shape...
            found[flag] = (False, f"{type(error).__name__}: {str(error).splitlines()[0][:120]}")
    return found


# ----------------------------------------------------------------------------------------------
# Models and the timed step.
# ----------------------------------------------------------------------------------------------


def _gpt2_config(sizes):
    from transformers import GPT2Config

    return GPT2Config(n_positions=SEQLEN, vocab_size=50257, **sizes)


def build_ours(sizes, paths):
    from flash_attn.models.gpt import GPTLMHeadModel

    config = _gpt2_config(sizes)
    flags = {flag: works for flag, (works, _) in paths.items() if flag in (
        "use_flash_attn", "fused_bias_fc", "fused_mlp", "fused_dropout_add_ln")}
    config.update(dict(flags, residual_in_fp32=flags["fused_dropout_add_ln"],
                       pad_vocab_size_multiple=8))
    model = GPTLMHeadModel(config, device=DEVICE)
    if paths["triton cross_entropy"][0]:
        from flash_attn.losses.cross_entropy import CrossEntropyLoss

        loss_fn = CrossEntropyLoss(ignore_index=-100, inplace_backward=True)
    else:
        def loss_fn(logits, labels):
            return F.cross_entropy(logits, labels, ignore_index=-100)

    def loss_of(ids):
        logits = model(ids).logits
        # Next-token labels without copying the logits: shift the ids, ignore the last position.
        labels = F.pad(ids[:, 1:], (0, 1), value=-100)
        return loss_fn(logits.flatten(0, 1), labels.flatten())

    return model, loss_of


def build_hf(sizes):
    from transformers import GPT2LMHeadModel

    config = _gpt2_config(sizes)
    config._attn_implementation = "sdpa"  # the constructor keyword differs across versions
    model = GPT2LMHeadModel(config).to(DEVICE)
    if model.config._attn_implementation != "sdpa":
        raise RuntimeError(f"HF picked attention {model.config._attn_implementation!r}, not sdpa")

    def loss_of(ids):
        return model(ids, labels=ids).loss

    return model, loss_of


def tokens_per_second(model, loss_of, batch):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    model.train()
    ids = torch.randint(0, 50257, (batch, SEQLEN), device="cuda")

    def step():
        with _autocast():
            loss = loss_of(ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    for _ in range(WARMUP):
        loss = step()
    if not math.isfinite(loss.item()):
        raise RuntimeError(f"non-finite loss {loss.item()}")
    times = []
    for _ in range(STEPS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return batch * SEQLEN / statistics.median(times)


def model_tflops(params, n_layer, d_model, tokens_per_s):
    """6 x params x tokens + 6 x layers x d_model x seq x tokens (the anchors' formula)."""
    return (6 * params + 6 * n_layer * d_model * SEQLEN) * tokens_per_s / 1e12


def main():
    if not torch.cuda.is_available():
        sys.exit("benchmark_gpt.py needs a CUDA GPU")
    torch.manual_seed(0)
    print(environment())
    paths = available_paths()
    print("fused paths:")
    for flag, (works, note) in paths.items():
        print(f"  {flag:22s} {'on ' if works else 'off'}  {note}")
    rows, series = [], {"ours": ([], []), "HF sdpa": ([], [])}
    for index, (name, sizes, batch) in enumerate(MODELS, 1):
        results, params = {}, float("nan")
        for impl, build in (("HF sdpa", lambda: build_hf(sizes)), ("ours", lambda: build_ours(sizes, paths))):
            try:
                model, loss_of = build()
                if impl == "HF sdpa":
                    params = sum(p.numel() for p in model.parameters())
                else:
                    print(f"{name} ours: {model.transformer.active_paths()}")
                results[impl] = tokens_per_second(model, loss_of, batch)
            except Exception as error:  # report the other measurement anyway
                print(f"{name} {impl} FAILED: {type(error).__name__}: {error}")
                results[impl] = float("nan")
            model = loss_of = None
            torch.cuda.empty_cache()
        for impl, tps in results.items():
            tflops = model_tflops(params, sizes["n_layer"], sizes["n_embd"], tps)
            rows.append([name, impl, batch, f"{tps:,.0f}", round(tflops, 1),
                         round(tps / results["HF sdpa"], 3)])
            series[impl][0].append(index)
            series[impl][1].append(tps)
        print(f"{name}: ours {results['ours']:,.0f} tok/s, HF sdpa {results['HF sdpa']:,.0f} tok/s, "
              f"ratio {results['ours'] / results['HF sdpa']:.3f}")
    notes = "Fused paths: " + "; ".join(f"{flag} {'on' if works else 'off (' + note + ')'}"
                                        for flag, (works, note) in paths.items())
    report("GPT-2 training step (seq 1024, bf16 autocast, fused AdamW)",
           ["model", "implementation", "batch", "tokens/s", "model TFLOP/s", "vs HF sdpa"], rows,
           notes=notes)
    save_plot("benchmark_gpt.png", "GPT-2 training tokens/s (1 = small b16, 2 = medium b8)",
              "model", "tokens/s", series)


if __name__ == "__main__":
    main()
