"""GPT-2 training step: our GPTLMHeadModel with every fused path that works on this machine vs HF
transformers' GPT2LMHeadModel (attn_implementation="sdpa") eager and under torch.compile, measured
in one run: tokens/s, model TFLOP/s, MFU and peak memory.

All: the GPT-2 shapes of flash_attn.models.presets, dropout 0, fp32 weights, bf16 autocast, seq
1024, torch.optim.AdamW(fused=True); GPT-2 small at batch 16, medium at batch 8. Ours pads the
vocabulary to a multiple of 8 (50264, a flash-attn training option) and uses flash_attn's Triton
cross-entropy when it works. Each fused piece is tried on a small input first (forward and
backward under autocast); one that fails is switched off and the reason printed. FLOPs per token
and MFU: flash_attn.models.presets.training_flops_per_token and training.metrics.peak_flops (the
GPU's bf16 peak), the same figures training/train.py shows. The torch.compile peer's first steps
(the compilation) are part of the warm-up, not the timing. "ours + CUDA graph" (GPU only): the
same model, its whole step (forward, backward, AdamW) captured once and replayed (capture_step),
so no CPU time is spent between kernels.

    python benchmarks/benchmark_gpt.py [--smoke] [--no-compile]

--smoke: a tiny config, seq 32, on CPU, to check the script itself; "ours" then runs with every
fused path off (they need CUDA) and the compile peer compiles with the "eager" backend (dynamo's
graph capture without Inductor's minutes of C++ builds). Nothing is downloaded.
"""

import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # training/ (MFU)
from _common import environment, note_stand_in, parse_args, report, save_plot  # noqa: E402

VOCAB = 50257
# (name, preset, overrides, batch); seqlen, warm-up and timed steps per model.
GPU_RUN = dict(device="cuda", seqlen=1024, warmup=3, steps=10, compile_backend="inductor",
               models=[("gpt2-small", "gpt2-small", {}, 16),
                       ("gpt2-medium", "gpt2-medium", {}, 8)])
SMOKE_RUN = dict(device="cpu", seqlen=32, warmup=1, steps=2, compile_backend="eager",
                 models=[("gpt2-tiny", "gpt2-small", dict(n_layer=2, n_embd=64, n_head=4), 2)])
IMPLEMENTATIONS = ("HF sdpa", "HF sdpa + compile", "ours", "ours + CUDA graph")


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


def _config(preset, overrides, seqlen, paths=None):
    """The preset's GPT2Config (dropout 0); with paths, the fused flags that work here."""
    from flash_attn.models.presets import gpt_config

    config = gpt_config(preset, VOCAB, seqlen, fused=paths is not None, **overrides)
    if paths is not None:
        for flag in ("use_flash_attn", "fused_bias_fc", "fused_mlp", "fused_dropout_add_ln"):
            setattr(config, flag, getattr(config, flag) and paths[flag][0])
        config.residual_in_fp32 = config.fused_dropout_add_ln
    return config


def flops_per_token(preset, overrides, seqlen):
    """Training FLOPs per token of the shape (counted on our model, built on the meta device)."""
    from flash_attn.models.gpt import GPTLMHeadModel
    from flash_attn.models.presets import training_flops_per_token

    model = GPTLMHeadModel(_config(preset, overrides, seqlen), device="meta")
    return training_flops_per_token(model, seqlen)


def build_ours(preset, overrides, paths, device, seqlen):
    from flash_attn.models.gpt import GPTLMHeadModel

    model = GPTLMHeadModel(_config(preset, overrides, seqlen, paths), device=device)
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

    return model, model, loss_of


def build_hf(preset, overrides, device, seqlen, compile_backend=None):
    """HF's GPT2LMHeadModel of the same shape, dropout 0; compiled with compile_backend if given.
    Returns (the module with the parameters, the callable that runs it, loss_of)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from flash_attn.models.presets import PRESETS

    sizes = dict(PRESETS[preset], **overrides)
    config = GPT2Config(n_positions=seqlen, vocab_size=VOCAB, resid_pdrop=0.0, embd_pdrop=0.0,
                        attn_pdrop=0.0, **sizes)
    config._attn_implementation = "sdpa"  # the constructor keyword differs across versions
    model = GPT2LMHeadModel(config).to(device)
    if model.config._attn_implementation != "sdpa":
        raise RuntimeError(f"HF picked attention {model.config._attn_implementation!r}, not sdpa")
    run = model if compile_backend is None else torch.compile(model, backend=compile_backend)

    def loss_of(ids):
        return run(ids, labels=ids).loss

    return model, run, loss_of


def capture_step(loss_of, ids, optimizer, warmup):
    """The whole training step (forward, backward, AdamW) captured once in a CUDA graph, as
    PyTorch's whole-network capture does it: warm-up steps on a side stream (Triton autotuning and
    cuBLASLt plans happen there), gradients None at capture so that the graph's backward writes
    them, autocast without its weight-cast cache. Returns the step: a replay, giving the loss."""
    def body():
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
            loss = loss_of(ids)
        loss.backward()
        optimizer.step()
        return loss

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            body()
            optimizer.zero_grad(set_to_none=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = body()

    def step():
        graph.replay()
        return static_loss

    return step


def measure(model, loss_of, batch, device, seqlen, warmup, steps, cuda_graph=False):
    """(tokens/s, peak bytes allocated over the steps or None on CPU) of the training step;
    cuda_graph: the step replayed from a CUDA graph (capture_step)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True, capturable=cuda_graph)
    model.train()
    ids = torch.randint(0, VOCAB, (batch, seqlen), device=device)

    def eager_step():
        with _autocast(device):
            loss = loss_of(ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    step = capture_step(loss_of, ids, optimizer, warmup) if cuda_graph else eager_step
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
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
    return batch * seqlen / statistics.median(times), peak


def main():
    args = parse_args(__doc__, compile_option=True)
    from training.metrics import peak_flops

    run = SMOKE_RUN if args.smoke else GPU_RUN
    device, seqlen = run["device"], run["seqlen"]
    torch.manual_seed(0)
    print(environment())
    if args.smoke:
        note_stand_in("'ours' is our GPTLMHeadModel with every fused path off and PyTorch's "
                      "cross-entropy (the fused paths need CUDA); 'HF sdpa + compile' compiles "
                      "with the eager backend")
        paths = {flag: (False, "not probed: smoke run on CPU") for flag in PROBES}
    else:
        paths = available_paths()
    peak, peak_source = peak_flops(torch.device(device))
    print(f"MFU against {peak_source} ({peak / 1e12:.3g} TFLOP/s)")
    print("fused paths:")
    for flag, (works, note) in paths.items():
        print(f"  {flag:22s} {'on ' if works else 'off'}  {note}")
    implementations = [impl for impl in IMPLEMENTATIONS
                       if not (args.no_compile and impl == "HF sdpa + compile")
                       and not (device != "cuda" and impl == "ours + CUDA graph")]
    builders = {
        "HF sdpa": lambda p, o: build_hf(p, o, device, seqlen),
        "HF sdpa + compile": lambda p, o: build_hf(p, o, device, seqlen, run["compile_backend"]),
        "ours": lambda p, o: build_ours(p, o, paths, device, seqlen),
    }
    builders["ours + CUDA graph"] = builders["ours"]  # the same model; measure() replays its step
    rows, series = [], {impl: ([], []) for impl in implementations}
    for index, (name, preset, overrides, batch) in enumerate(run["models"], 1):
        flops = flops_per_token(preset, overrides, seqlen)
        results = {}
        for impl in implementations:
            print(f"{name} {impl} ...", flush=True)
            model = loss_of = None
            try:
                model, _, loss_of = builders[impl](preset, overrides)
                if impl == "ours":
                    print(f"{name} ours: {model.transformer.active_paths()}")
                results[impl] = measure(model, loss_of, batch, device, seqlen, run["warmup"],
                                        run["steps"], cuda_graph=impl == "ours + CUDA graph")
            except Exception as error:  # report the other measurements anyway
                print(f"{name} {impl} FAILED: {type(error).__name__}: {error}")
                results[impl] = (float("nan"), None)
            model = loss_of = None
            torch._dynamo.reset()
            if device == "cuda":
                torch.cuda.empty_cache()
        base = results["HF sdpa"][0]
        compiled = results.get("HF sdpa + compile", (float("nan"), None))[0]
        for impl, (tps, peak_bytes) in results.items():
            memory = "-" if peak_bytes is None else round(peak_bytes / 2 ** 30, 1)
            rows.append([name, impl, batch, f"{tps:,.0f}", round(tps * flops / 1e12, 1),
                         round(100 * tps * flops / peak, 1), memory, round(tps / base, 3),
                         round(tps / compiled, 3)])
            series[impl][0].append(index)
            series[impl][1].append(tps)
        print(f"{name}: " + ", ".join(f"{impl} {tps:,.0f} tok/s" for impl, (tps, _) in
                                      results.items()), flush=True)
    notes = ("ours + CUDA graph: the same model, the whole step (forward, backward, AdamW "
             "capturable) replayed from one CUDA graph. FLOPs per token: 6 x the weights a token "
             "is multiplied by (position embeddings left out) + 6 x layers x width x seq (causal "
             "attention); MFU against "
             f"{peak_source}. Peak memory: torch.cuda.max_memory_allocated over the warm-up and "
             "timed steps (weights, gradients, AdamW state, activations). Fused paths: " +
             "; ".join(f"{flag} {'on' if works else 'off (' + note + ')'}"
                       for flag, (works, note) in paths.items()))
    report(f"GPT-2 training step (seq {seqlen}, dropout 0, bf16 autocast, fused AdamW)",
           ["model", "implementation", "batch", "tokens/s", "model TFLOP/s", "MFU %",
            "peak GiB", "vs HF sdpa", "vs HF sdpa + compile"], rows, notes=notes)
    legend = ", ".join(f"{index} = {name.removeprefix('gpt2-')} b{batch}"
                       for index, (name, _, _, batch) in enumerate(run["models"], 1))
    save_plot("benchmark_gpt.png", f"GPT-2 training tokens/s ({legend})", "model", "tokens/s",
              series)


if __name__ == "__main__":
    main()
