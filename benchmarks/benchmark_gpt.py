"""GPT-2 training step, tokens/s: our GPTLMHeadModel with every fused path that works on this
machine vs HF transformers' GPT2LMHeadModel (attn_implementation="sdpa"), measured in one run.

Both: GPT-2 config (dropout 0.1), fp32 weights, bf16 autocast, seq 1024, torch.optim.AdamW
(fused=True); GPT-2 small at batch 16, medium at batch 8. Ours pads the vocabulary to a multiple
of 8 (50264, a flash-attn training option) and uses flash_attn's Triton cross-entropy when it
works. Each fused piece is tried on a small input first (forward and backward under autocast);
one that fails is switched off and the reason printed.

    python benchmarks/benchmark_gpt.py [--smoke]

--smoke: a tiny GPT-2 config, seq 32, on CPU, to check the script itself; "ours" then runs with
every fused path off (they need CUDA). Both models are built from a config: nothing is downloaded.
"""

import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import environment, note_stand_in, parse_args, report, save_plot  # noqa: E402

VOCAB = 50257
# (name, GPT2Config sizes, batch); seqlen, warm-up and timed steps per model.
GPU_RUN = dict(device="cuda", seqlen=1024, warmup=3, steps=10,
               models=[("gpt2-small", dict(n_layer=12, n_embd=768, n_head=12), 16),
                       ("gpt2-medium", dict(n_layer=24, n_embd=1024, n_head=16), 8)])
SMOKE_RUN = dict(device="cpu", seqlen=32, warmup=1, steps=2,
                 models=[("gpt2-tiny", dict(n_layer=2, n_embd=64, n_head=4), 2)])


# ----------------------------------------------------------------------------------------------
# Which fused paths work here.
# ----------------------------------------------------------------------------------------------


def _autocast(device="cuda"):
    return torch.autocast(device, dtype=torch.bfloat16)


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


def _gpt2_config(sizes, seqlen):
    from transformers import GPT2Config

    return GPT2Config(n_positions=seqlen, vocab_size=VOCAB, **sizes)


def build_ours(sizes, paths, device, seqlen):
    from flash_attn.models.gpt import GPTLMHeadModel

    config = _gpt2_config(sizes, seqlen)
    flags = {flag: works for flag, (works, _) in paths.items() if flag in (
        "use_flash_attn", "fused_bias_fc", "fused_mlp", "fused_dropout_add_ln")}
    config.update(dict(flags, residual_in_fp32=flags["fused_dropout_add_ln"],
                       pad_vocab_size_multiple=8))
    model = GPTLMHeadModel(config, device=device)
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


def build_hf(sizes, device, seqlen):
    from transformers import GPT2LMHeadModel

    config = _gpt2_config(sizes, seqlen)
    config._attn_implementation = "sdpa"  # the constructor keyword differs across versions
    model = GPT2LMHeadModel(config).to(device)
    if model.config._attn_implementation != "sdpa":
        raise RuntimeError(f"HF picked attention {model.config._attn_implementation!r}, not sdpa")

    def loss_of(ids):
        return model(ids, labels=ids).loss

    return model, loss_of


def tokens_per_second(model, loss_of, batch, device, seqlen, warmup, steps):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    model.train()
    ids = torch.randint(0, VOCAB, (batch, seqlen), device=device)

    def step():
        with _autocast(device):
            loss = loss_of(ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    for _ in range(warmup):
        loss = step()
    if not math.isfinite(loss.item()):
        raise RuntimeError(f"non-finite loss {loss.item()}")
    times = []
    for _ in range(steps):
        if device != "cuda":  # --smoke: wall clock
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return batch * seqlen / statistics.median(times)


def model_tflops(params, n_layer, d_model, seqlen, tokens_per_s):
    """6 x params x tokens + 6 x layers x d_model x seq x tokens (the anchors' formula)."""
    return (6 * params + 6 * n_layer * d_model * seqlen) * tokens_per_s / 1e12


def main():
    args = parse_args(__doc__)
    run = SMOKE_RUN if args.smoke else GPU_RUN
    device, seqlen = run["device"], run["seqlen"]
    torch.manual_seed(0)
    print(environment())
    if args.smoke:
        note_stand_in("'ours' is our GPTLMHeadModel with every fused path off and PyTorch's "
                      "cross-entropy (the fused paths need CUDA)")
        paths = {flag: (False, "not probed: smoke run on CPU") for flag in PROBES}
    else:
        paths = available_paths()
    print("fused paths:")
    for flag, (works, note) in paths.items():
        print(f"  {flag:22s} {'on ' if works else 'off'}  {note}")
    rows, series = [], {"ours": ([], []), "HF sdpa": ([], [])}
    for index, (name, sizes, batch) in enumerate(run["models"], 1):
        results, params = {}, float("nan")
        for impl, build in (("HF sdpa", lambda: build_hf(sizes, device, seqlen)),
                            ("ours", lambda: build_ours(sizes, paths, device, seqlen))):
            print(f"{name} {impl} ...", flush=True)
            try:
                model, loss_of = build()
                if impl == "HF sdpa":
                    params = sum(p.numel() for p in model.parameters())
                else:
                    print(f"{name} ours: {model.transformer.active_paths()}")
                results[impl] = tokens_per_second(model, loss_of, batch, device, seqlen,
                                                  run["warmup"], run["steps"])
            except Exception as error:  # report the other measurement anyway
                print(f"{name} {impl} FAILED: {type(error).__name__}: {error}")
                results[impl] = float("nan")
            model = loss_of = None
            torch.cuda.empty_cache()
        for impl, tps in results.items():
            tflops = model_tflops(params, sizes["n_layer"], sizes["n_embd"], seqlen, tps)
            rows.append([name, impl, batch, f"{tps:,.0f}", round(tflops, 1),
                         round(tps / results["HF sdpa"], 3)])
            series[impl][0].append(index)
            series[impl][1].append(tps)
        print(f"{name}: ours {results['ours']:,.0f} tok/s, HF sdpa {results['HF sdpa']:,.0f} tok/s, "
              f"ratio {results['ours'] / results['HF sdpa']:.3f}")
    notes = "Fused paths: " + "; ".join(f"{flag} {'on' if works else 'off (' + note + ')'}"
                                        for flag, (works, note) in paths.items())
    report(f"GPT-2 training step (seq {seqlen}, bf16 autocast, fused AdamW)",
           ["model", "implementation", "batch", "tokens/s", "model TFLOP/s", "vs HF sdpa"], rows,
           notes=notes)
    legend = ", ".join(f"{index} = {name.removeprefix('gpt2-')} b{batch}"
                       for index, (name, _, batch) in enumerate(run["models"], 1))
    save_plot("benchmark_gpt.png", f"GPT-2 training tokens/s ({legend})", "model", "tokens/s",
              series)


if __name__ == "__main__":
    main()
