"""Cross-entropy forward+backward over large vocabularies: time and peak memory of ours (Triton,
with and without inplace_backward) vs F.cross_entropy (eager and torch.compile), same run.

16k tokens, bf16 logits, vocab 50257 (GPT-2) and 128256 (Llama 3), mean over tokens.
Done-when checks: ours (fwd+bwd) faster than F.cross_entropy; with inplace_backward, no extra
logits-sized allocation (peak extra memory < 5% of the logits).
Usage: python benchmarks/benchmark_cross_entropy.py [--smoke] [--no-compile]   (--smoke: tiny
shapes on CPU, Triton in its interpreter, to check the script itself)
"""

import functools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import copy_bandwidth, gbps, parse_args, report, save_plot, time_ms, wall_ms  # noqa: E402

# flash_attn's cross-entropy modules define Triton kernels, so they are imported in the functions
# below, after parse_args has turned Triton's interpreter on for --smoke.

MEMORY_TARGET = 0.05  # inplace_backward: extra peak memory / logits bytes


def _losses(compile_peer):
    from flash_attn.losses.cross_entropy import CrossEntropyLoss

    fns = {
        "ours": CrossEntropyLoss(),
        "ours inplace_backward": CrossEntropyLoss(inplace_backward=True),
        "F.cross_entropy": F.cross_entropy,
    }
    if compile_peer:
        fns["F.cross_entropy compiled"] = torch.compile(F.cross_entropy, dynamic=False)
    return fns


def _fwd_bwd(loss_fn, logits, labels):
    def step():
        loss = loss_fn(logits, labels)
        # autograd.grad: the gradient is returned, not accumulated into logits.grad.
        return torch.autograd.grad(loss, logits)[0]
    return step


def _peak_extra_bytes(fn):
    if not torch.cuda.is_available():
        return float("nan")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    del out
    return extra


def run_vocab(vocab, tokens, device, timer, compile_peer):
    gen = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(tokens, vocab, device=device, generator=gen).to(torch.bfloat16)
    labels = torch.randint(0, vocab, (tokens,), device=device, generator=gen)
    logits_bytes = logits.numel() * logits.element_size()
    copy_gbps = copy_bandwidth(logits, timer)
    # Correctness guard: every method's gradient against the fp32 one.
    ref = _fwd_bwd(F.cross_entropy, logits.float().requires_grad_(), labels)()
    rows, results = [], {}
    for name, fn in _losses(compile_peer).items():
        # inplace_backward overwrites its logits with the gradient: give it its own copy.
        x = (logits.clone() if "inplace" in name else logits).requires_grad_()
        step = _fwd_bwd(fn, x, labels)
        grad = step()
        err = (grad.float() - ref).abs().max().item()
        del grad
        extra = _peak_extra_bytes(step)
        ms = timer(step)
        fwd_ms = timer(lambda: fn(x, labels)) if "compiled" not in name else float("nan")
        results[name] = (ms, extra)
        rows.append([vocab, name, ms, fwd_ms, extra / 2**20, extra / logits_bytes, err])
        print(rows[-1], flush=True)
        x.requires_grad_(False)
        del x
    del ref
    # Ours moves 3 logits-sized passes (forward read, backward read + write).
    ours_gbps = gbps(3 * logits_bytes, results["ours"][0])
    return rows, results, copy_gbps, ours_gbps


def run_config_sweep(vocab, tokens, device, timer):
    """Kernel time of a few block sizes, to check the default heuristic."""
    from flash_attn.ops.triton.cross_entropy import _backward_launch, _forward_launch

    logits = torch.randn(tokens, vocab, device=device).to(torch.bfloat16)
    labels = torch.randint(0, vocab, (tokens,), device=device)
    losses, z_losses, lse = (torch.empty(tokens, device=device) for _ in range(3))
    dlogits, dlosses = torch.empty_like(logits), torch.ones(tokens, device=device)
    args = (0.0, 1.0, 0.0, -100, vocab, 0)
    rows = []
    for block, warps in ((None, None), (1024, 4), (2048, 4), (4096, 8), (8192, 8)):
        ms = timer(lambda: _forward_launch(logits, labels, losses, z_losses, lse, *args,
                                           split=False, block=block, num_warps=warps))
        rows.append(["forward", "default" if block is None else f"{block}, {warps} warps", ms])
    for block, warps in ((None, None), (1024, 4), (2048, 4), (4096, 8), (8192, 8)):
        ms = timer(lambda: _backward_launch(dlogits, dlosses, logits, lse, labels, *args,
                                            block=block, num_warps=warps))
        rows.append(["backward", "default" if block is None else f"{block}, {warps} warps", ms])
    report(f"Cross-entropy launch configurations (vocab {vocab}, {tokens} tokens, bf16)",
           ["kernel", "BLOCK, warps", "ms"], rows)


def main():
    args = parse_args(__doc__, compile_option=True)
    if args.smoke:
        device, timer, tokens, vocabs = "cpu", functools.partial(wall_ms, reps=2), 8, (503, 1000)
    else:
        device, timer, tokens, vocabs = "cuda", time_ms, 16384, (50257, 128256)
    compile_peer = not (args.smoke or args.no_compile)
    all_rows, checks, series = [], [], {}
    for vocab in vocabs:
        print(f"vocab {vocab} ...", flush=True)
        rows, results, copy_gbps, ours_gbps = run_vocab(vocab, tokens, device, timer, compile_peer)
        all_rows += rows
        checks.append((vocab, results, copy_gbps, ours_gbps))
        for name, (ms, _) in results.items():
            series.setdefault(name, ([], []))
            series[name][0].append(vocab)
            series[name][1].append(ms)
    report(f"Cross-entropy forward+backward ({tokens} tokens, bf16 logits, mean)",
           ["vocab", "method", "fwd+bwd ms", "fwd ms", "peak extra MiB", "extra / logits",
            "max |grad - fp32 ref|"], all_rows,
           notes="Peak extra memory: beyond the logits and labels, during forward+backward "
                 "(the returned gradient included).")
    save_plot("cross_entropy.png", f"Cross-entropy fwd+bwd, {tokens} tokens, bf16", "vocab size",
              "ms", series)
    for vocab, results, copy_gbps, ours_gbps in checks:
        ours, peer = results["ours"][0], results["F.cross_entropy"][0]
        print(f"CHECK vocab {vocab}: ours fwd+bwd {ours:.3f} ms vs F.cross_entropy {peer:.3f} ms "
              f"(speed-up {peer / ours:.2f}x): {'PASS' if ours < peer else 'FAIL'}")
        ours_ip = results["ours inplace_backward"][0]
        print(f"CHECK vocab {vocab}: ours inplace_backward fwd+bwd {ours_ip:.3f} ms vs "
              f"F.cross_entropy {peer:.3f} ms: {'PASS' if ours_ip < peer else 'FAIL'}")
        if "F.cross_entropy compiled" in results:
            comp = results["F.cross_entropy compiled"][0]
            print(f"INFO vocab {vocab}: vs F.cross_entropy compiled {comp:.3f} ms: "
                  f"{comp / ours:.2f}x")
        logits_bytes = tokens * vocab * 2
        frac = results["ours inplace_backward"][1] / logits_bytes
        print(f"CHECK vocab {vocab}: inplace_backward peak extra memory = {frac:.3f} x logits "
              f"(target < {MEMORY_TARGET}): {'PASS' if frac < MEMORY_TARGET else 'FAIL'}")
        print(f"INFO vocab {vocab}: ours moves 3 logits passes at {ours_gbps:.0f} GB/s = "
              f"{ours_gbps / copy_gbps:.2f} x copy bandwidth ({copy_gbps:.0f} GB/s)")
    run_config_sweep(vocabs[-1], tokens, device, timer)


if __name__ == "__main__":
    main()
