"""Train a GPT (flash_attn.models.gpt.GPTLMHeadModel) from the command line.

    python training/train.py                         # sized for this machine, nothing to download
    python training/train.py --preset gpt2-medium --data corpus.txt --steps 5000
    python training/train.py --resume                # continue the run in out/
    torchrun --nproc_per_node 8 training/train.py --parallel fsdp

With no arguments it trains on the Python standard library's sources (bytes, so a vocabulary of
256): on a CPU a small GPT for a few minutes, on a GPU GPT-2 small with every fused path (flash
attention, fused dense and MLP, fused dropout + add + LayerNorm, Triton cross-entropy) under bf16
autocast. AdamW (fused where the device has it) with weight decay on the matrices only, linear
warm-up then cosine decay, gradient clipping and accumulation; periodic validation on fixed
windows; checkpoints every --checkpoint-every steps and at the end; out/loss.png,
out/metrics.json and a sample of generated text (out/sample.txt) at the end.

--batch-size and --grad-accum are per process: a step reads batch x grad-accum x processes
sequences. `python training/train.py --help` lists every option and its default.
"""

import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `training` and `flash_attn` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# OpenMP threads that spin while waiting for each other stall whenever another process holds a
# core: on a busy 2-core machine a CPU step took 10x longer. Sleeping waits cost ~5% when idle.
# (Read when torch loads OpenMP, so it must be set before the import.)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
import torch.nn.functional as F
from transformers import GPT2Config

from flash_attn.models.gpt import GPTLMHeadModel
from flash_attn.models.presets import gpt_config, training_flops_per_token
from training import checkpoint, data, parallel
from training.metrics import Progress, Throughput, peak_flops, save_loss_plot
from training.options import COMMON, UsageError, check_out, explicit_options, resolve

PROMPT_TOKENS = 64


@dataclass
class Run:
    """Everything decided before training starts."""
    args: object
    corpus: data.Corpus
    config: GPT2Config
    resumed: dict  # the payload of the checkpoint resumed from, or None


def prepare(explicit, resume):
    """Check the options, load the data and build the model config; UsageError or
    data.DataError on anything the run cannot start with. Creates --out last, after every
    other check, and writes nothing else."""
    out = Path(explicit.get("out", COMMON["out"]))
    latest = checkpoint.latest_checkpoint(out)
    if resume and latest is None:
        raise UsageError(f"--resume: no checkpoint in {out} to resume from")
    if not resume and latest is not None:
        raise UsageError(f"--out {out} already holds a run (checkpoint {latest.name}): pass "
                         "--resume to continue it, or choose another --out")
    resumed = checkpoint.read(latest) if resume else None
    args = resolve(explicit, resumed["args"] if resumed else None)
    corpus = data.load_corpus(args.data, args.vocab_size)
    data.check_length(corpus, args.seqlen)
    if resumed is not None:
        data.check_resumable(resumed["data"], len(corpus.train), args.seqlen, args.seed)
    fused = torch.device(args.device).type == "cuda"
    try:
        config = gpt_config(args.preset, corpus.vocab_size, args.seqlen, fused=fused,
                            n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head,
                            n_head_kv=args.n_head_kv, dropout=args.dropout)
    except ValueError as error:
        given = [f"--preset {args.preset}"] + [
            f"--{name.replace('_', '-')} {getattr(args, name)}"
            for name in ("n_layer", "n_embd", "n_head", "n_head_kv")
            if getattr(args, name) is not None]
        raise UsageError(f"the model ({', '.join(given)}): {error}") from None
    check_out(out)
    return Run(args, corpus, config, resumed)


def lr_factor(step, warmup, steps, min_ratio):
    """The learning rate of optimizer step `step` (0-based) over the peak: linear warm-up, then
    cosine decay to min_ratio at the last step."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - 1 - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def make_optimizer(model, args):
    """AdamW, weight decay on matrices (embeddings included) only; fused where the device has
    a fused kernel, else the multi-tensor form."""
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": args.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    try:
        return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), fused=True), "fused"
    except RuntimeError:  # "`fused=True` requires all the params to be ... supported devices"
        return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95)), "foreach"


def make_loss(fused):
    """Mean next-token cross-entropy of logits (b, s, vocab) against targets (b, s): flash_attn's
    Triton kernel on a GPU (bf16 logits in, fp32 inside), else PyTorch's in fp32."""
    if fused:
        try:
            from flash_attn.losses.cross_entropy import CrossEntropyLoss

            triton_loss = CrossEntropyLoss(inplace_backward=True)
            return (lambda logits, targets: triton_loss(logits.flatten(0, 1), targets.flatten()),
                    "flash_attn triton cross_entropy")
        except ImportError as error:
            print(f"flash_attn's cross-entropy is unavailable ({error}); using PyTorch's")
    return (lambda logits, targets: F.cross_entropy(logits.flatten(0, 1).float(),
                                                    targets.flatten()),
            "torch cross_entropy")


class Trainer:
    def __init__(self, run, processes):
        self.run, self.processes = run, processes
        self.args, self.corpus, self.config = run.args, run.corpus, run.config
        args, device = self.args, processes.device
        self.out = Path(args.out)
        self.fused = device.type == "cuda"
        torch.manual_seed(args.seed)  # the same initial weights in every process
        model = GPTLMHeadModel(self.config, device=device)
        self.n_params = sum(p.numel() for p in model.parameters())
        self.flops_per_token = training_flops_per_token(model, args.seqlen)
        self.paths = model.transformer.active_paths()
        self.model = parallel.wrap(model, processes, args.parallel)
        self.optimizer, self.optimizer_kind = make_optimizer(self.model, args)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda step: lr_factor(step, args.warmup, args.steps, args.min_lr_ratio))
        self.loss_fn, self.loss_kind = make_loss(self.fused)
        self.autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=self.fused)
        self.sampler = data.WindowSampler(len(self.corpus.train), args.seqlen, args.seed)
        self.global_batch = args.batch_size * processes.world_size
        self.val_starts = data.val_starts(len(self.corpus.val), args.seqlen,
                                          args.eval_batches * self.global_batch)
        self.history = {"train": [], "val": []}  # [step, loss, lr, grad norm], [step, loss]
        self.step = 0
        self.progress = None
        if run.resumed is not None:
            self._restore(run.resumed)
        else:
            torch.manual_seed(args.seed + 1 + processes.rank)  # dropout differs per process

    # -- state ------------------------------------------------------------------------------

    def _state_model(self):
        """The module whose state is saved: the model itself (FSDP2 shards it in place), not
        a DDP wrapper."""
        return parallel.unwrap(self.model)

    def _restore(self, payload):
        checkpoint.load_state(self._state_model(), self.optimizer, payload["model"],
                              payload["optimizer"])
        self.scheduler.load_state_dict(payload["scheduler"])
        # The schedule of this run's --lr and --steps (the checkpoint's unless given again):
        # LambdaLR's own formula, so an unchanged schedule gives the same rates bit for bit.
        self.scheduler.base_lrs = [self.args.lr] * len(self.optimizer.param_groups)
        for group, factor in zip(self.optimizer.param_groups, self.scheduler.lr_lambdas):
            group["initial_lr"], group["lr"] = self.args.lr, self.args.lr * factor(payload["step"])
        self.sampler.load_state_dict(payload["data"])
        self.history = payload["history"]
        self.step = payload["step"]
        self.log(f"resuming at step {self.step}")
        rngs = payload["rng"]
        if len(rngs) == self.processes.world_size:
            checkpoint.set_rng_state(rngs[self.processes.rank], self.processes.device)
        else:
            torch.manual_seed(self.args.seed + 1 + self.processes.rank + self.step)
            self.log(f"the checkpoint holds RNG states of {len(rngs)} processes, this run has "
                     f"{self.processes.world_size}: dropout masks are drawn afresh")

    def save_checkpoint(self):
        model_state, optimizer_state = checkpoint.gather_state(self._state_model(), self.optimizer)
        rngs = self.processes.gather(checkpoint.rng_state(self.processes.device))
        if self.processes.is_main:
            path = checkpoint.checkpoint_path(self.out, self.step)
            checkpoint.save(path, dict(
                step=self.step, model=model_state, optimizer=optimizer_state,
                scheduler=self.scheduler.state_dict(), data=self.sampler.state_dict(), rng=rngs,
                config=self.config.to_json_string(), args=dict(vars(self.args)),
                history=self.history))
            checkpoint.prune(self.out, self.args.keep_checkpoints)
            self.write_reports()
            self.log(f"checkpoint {path}")
        self.processes.barrier()

    def write_reports(self):
        checkpoint.write_json(self.out / "metrics.json", dict(
            preset=self.args.preset, params=self.n_params, tokens_per_step=self.tokens_per_step,
            flops_per_token=self.flops_per_token, history=self.history))
        title = (f"{self.args.preset}, {self.n_params / 1e6:.1f}M parameters, "
                 f"{self.tokens_per_step:,} tokens/step")
        if not save_loss_plot(self.out / "loss.png", self.history, title):
            self.log("matplotlib is not installed: no loss.png")

    # -- steps ------------------------------------------------------------------------------

    @property
    def tokens_per_step(self):
        return self.global_batch * self.args.grad_accum * self.args.seqlen

    def log(self, line):
        if not self.processes.is_main:
            return
        if self.progress is not None:
            self.progress.write(line)
        else:
            print(line, flush=True)

    def _batch(self, tokens, starts):
        mine = data.rank_slice(starts, self.processes.rank, self.args.batch_size)
        return data.windows(tokens, mine, self.args.seqlen, self.processes.device)

    def _loss(self, inputs, targets):
        with self.autocast:
            if self.args.loss == "chunked":
                return self.model(inputs, targets=targets).loss
            logits = self.model(inputs).logits
        return self.loss_fn(logits, targets)

    def train_step(self):
        """One optimizer step over grad_accum micro-batches; (mean loss, grad norm) over every
        process."""
        self.model.train()
        accum = self.args.grad_accum
        loss_sum = torch.zeros((), device=self.processes.device)
        for micro in range(accum):
            inputs, targets = self._batch(self.corpus.train,
                                          self.sampler.next_starts(self.global_batch))
            with parallel.gradient_sync(self.model, enabled=micro == accum - 1):
                loss = self._loss(inputs, targets)
                (loss / accum).backward()
            loss_sum += loss.detach()
        max_norm = self.args.grad_clip if self.args.grad_clip > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        if hasattr(grad_norm, "full_tensor"):  # FSDP: a DTensor
            grad_norm = grad_norm.full_tensor()
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return self.processes.mean(loss_sum / accum), float(grad_norm), lr

    @torch.no_grad()
    def evaluate(self):
        """Mean loss over the fixed validation windows (each process takes its share)."""
        self.model.eval()
        total = torch.zeros((), device=self.processes.device)
        for i in range(self.args.eval_batches):
            batch = self.val_starts[i * self.global_batch: (i + 1) * self.global_batch]
            total += self._loss(*self._batch(self.corpus.val, batch))
        return self.processes.mean(total / self.args.eval_batches)

    def train(self):
        args = self.args
        peak, peak_source = peak_flops(self.processes.device, args.peak_tflops)
        self.print_header(peak_source)
        self.progress = Progress(args.steps, self.step, self.processes.is_main)
        if self.step == 0:
            self.record_val()
        throughput = Throughput()
        while self.step < args.steps:
            start = time.perf_counter()
            loss, grad_norm, lr = self.train_step()  # the loss's .item() waits for the step
            throughput.add(self.tokens_per_step, time.perf_counter() - start)
            self.history["train"].append([self.step, loss, lr, grad_norm])
            tokens_per_s = throughput.tokens_per_second()
            mfu = tokens_per_s * self.flops_per_token / (peak * self.processes.world_size)
            self.progress.update(self.step, loss, tokens_per_s, mfu)
            if self.step % args.eval_every == 0 or self.step == args.steps:
                self.record_val(f" | train {loss:.4f} | lr {lr:.2e} | "
                                f"{tokens_per_s:,.0f} tok/s | MFU {100 * mfu:.1f}%")
            if self.step % args.checkpoint_every == 0 or self.step == args.steps:
                self.save_checkpoint()
        self.progress.close()
        self.progress = None
        if self.processes.is_main and self.history["val"]:
            (first_step, first), (last_step, last) = self.history["val"][0], self.history["val"][-1]
            print(f"validation loss {first:.4f} (step {first_step}) -> {last:.4f} "
                  f"(step {last_step})", flush=True)

    def record_val(self, extra=""):
        val = self.evaluate()
        self.history["val"].append([self.step, val])
        self.log(f"step {self.step}/{self.args.steps} | val {val:.4f}{extra}")

    def print_header(self, peak_source):
        if not self.processes.is_main:
            return
        args, p = self.args, self.processes
        corpus = self.corpus
        print(f"data: {corpus.description}: {data.describe_tokens(len(corpus.train))} train / "
              f"{data.describe_tokens(len(corpus.val))} val tokens, vocabulary "
              f"{corpus.vocab_size}")
        config = self.config
        heads = f"{config.n_head}" + (f" ({config.n_head_kv} key/value)"
                                      if getattr(config, "n_head_kv", None) else "")
        print(f"model: {args.preset}, {self.n_params / 1e6:.2f}M parameters, layers "
              f"{config.n_layer}, width {config.n_embd}, heads {heads}, seqlen {args.seqlen}")
        paths = ", ".join(f"{k}: {v}" for k, v in self.paths.items())
        print(f"paths: {paths}, loss: {self.loss_kind}, AdamW: {self.optimizer_kind}, "
              f"{'bf16 autocast' if self.fused else 'fp32'}")
        mode = f"{p.world_size} processes, {args.parallel}" if p.distributed else "1 process"
        print(f"run: {p.device}, {mode}, {args.steps} steps of {self.tokens_per_step:,} tokens "
              f"({args.batch_size} x {args.grad_accum} x {p.world_size} sequences), MFU against "
              f"{peak_source}, output {self.out}", flush=True)

    # -- the end ------------------------------------------------------------------------------

    def sample(self):
        """Text generated by the trained model from the start of the validation split (KV-cache
        decoding), printed and written to out/sample.txt; only the main process."""
        args = self.args
        if args.sample_tokens == 0 or not self.processes.is_main:
            return
        model = self._sampling_model()
        model.eval()
        positions = self.config.n_positions  # 0: rotary, any length
        prompt_len = min(PROMPT_TOKENS, len(self.corpus.val), max(1, positions // 4) if positions
                         else PROMPT_TOKENS)
        max_length = prompt_len + args.sample_tokens
        if positions:
            max_length = min(max_length, positions)
        prompt = torch.from_numpy(self.corpus.val[:prompt_len].astype("int64"))
        prompt = prompt.unsqueeze(0).to(self.processes.device)
        torch.manual_seed(args.seed)
        with self.autocast:
            ids = model.generate(prompt, max_length=max_length, top_k=40, temperature=0.8,
                                 vocab_size=self.corpus.vocab_size)
        ids = ids[0].tolist()
        text = (self.corpus.decode(ids[:prompt_len]) + " >>> " +
                self.corpus.decode(ids[prompt_len:]))
        (self.out / "sample.txt").write_text(text)
        print(f"sample ({prompt_len} prompt tokens from the validation split >>> "
              f"{len(ids) - prompt_len} generated):\n{text}", flush=True)

    def _sampling_model(self):
        if not parallel.is_sharded(self.model):
            return parallel.unwrap(self.model)
        # FSDP: a whole copy, from the checkpoint just written at the last step.
        model = GPTLMHeadModel(self.config, device=self.processes.device)
        payload = checkpoint.read(checkpoint.latest_checkpoint(self.out))
        model.load_state_dict(payload["model"])
        return model


def main(argv=None):
    explicit, resume = explicit_options(argv)
    try:
        run = prepare(explicit, resume)
    except (UsageError, data.DataError) as error:
        if parallel.launch_rank() == 0:
            print(f"train.py: error: {error}", file=sys.stderr)
        return 2
    processes = parallel.start(run.args.device)
    try:
        train(run, processes)
    finally:
        # The job is a function so that its model is garbage by now: stop() then ends the
        # process group here, not gloo's destructor at interpreter exit (seen to hang or abort).
        parallel.stop()
    return 0


def train(run, processes):
    """The run in this process: train, sample, then meet the other processes."""
    if run.args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 products outside autocast
    started = time.perf_counter()
    trainer = Trainer(run, processes)
    trainer.train()
    trainer.sample()
    # The other processes wait out the main one's sample, so that all leave the process group
    # together: one that tore gloo down while the main process still sampled was seen to abort
    # ("terminate called without an active exception", FSDP on CPU).
    processes.barrier()
    if processes.is_main:
        print(f"done in {time.perf_counter() - started:.0f} s; {trainer.out}: checkpoints/, "
              "metrics.json, loss.png, sample.txt", flush=True)


if __name__ == "__main__":
    sys.exit(main())
