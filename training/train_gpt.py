"""Train a small GPT (byte-level, vocab 256) on a text file with flash_attn's GPTLMHeadModel.

    python training/train_gpt.py --data input.txt --steps 2000            # GPU: every fused path
    python training/train_gpt.py --steps 50 --n-layer 2 --n-embd 128      # CPU, synthetic text

bf16 autocast on CUDA, AdamW (fused on CUDA) with weight decay on matrices only, linear warmup
then cosine decay, gradient clipping. Writes the final state dict to --out and prints a sample.
"""

import argparse
import math
import time

import torch
import torch.nn.functional as F
from transformers import GPT2Config

from flash_attn.models.gpt import GPTLMHeadModel


def load_bytes(path):
    if path is None:  # something with structure to learn, so the loss visibly drops
        text = "".join(f"{i} squared is {i * i}.\n" for i in range(2000))
        return torch.tensor(list(text.encode()), dtype=torch.long)
    with open(path, "rb") as f:
        return torch.tensor(list(f.read()), dtype=torch.long)


def batches(data, batch, seqlen, device, generator):
    while True:
        starts = torch.randint(0, len(data) - seqlen - 1, (batch,), generator=generator)
        chunk = torch.stack([data[s: s + seqlen + 1] for s in starts]).to(device)
        yield chunk[:, :-1], chunk[:, 1:]


def fused_flags(device):
    """Every fused path on a GPU (each module falls back, with a warning, if one is missing)."""
    if device.type != "cuda":
        return {}
    return dict(use_flash_attn=True, fused_bias_fc=True, fused_mlp=True,
                fused_dropout_add_ln=True, residual_in_fp32=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=None, help="a text file (default: synthetic text)")
    parser.add_argument("--n-layer", type=int, default=6)
    parser.add_argument("--n-embd", type=int, default=384)
    parser.add_argument("--n-head", type=int, default=6)
    parser.add_argument("--seqlen", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--out", default="gpt_bytes.pt")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)

    data = load_bytes(args.data)
    split = int(0.9 * len(data))
    train_data, val_data = data[:split], data[split:]
    config = GPT2Config(vocab_size=256, n_positions=args.seqlen, n_embd=args.n_embd,
                        n_layer=args.n_layer, n_head=args.n_head, resid_pdrop=args.dropout,
                        embd_pdrop=args.dropout, attn_pdrop=args.dropout, **fused_flags(device))
    model = GPTLMHeadModel(config, device=device)
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters;",
          model.transformer.active_paths())

    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.95), fused=device.type == "cuda")

    def lr_at(step):
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        progress = (step - args.warmup) / max(1, args.steps - args.warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    generator = torch.Generator().manual_seed(0)
    train_batches = batches(train_data, args.batch, args.seqlen, device, generator)
    val_batches = batches(val_data, args.batch, args.seqlen, device, generator)

    def loss_on(inputs, targets):
        with autocast:
            logits = model(inputs).logits
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    start = time.perf_counter()
    for step in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        model.train()
        loss = loss_on(*next(train_batches))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 100 == 0 or step == args.steps - 1:
            model.eval()
            with torch.no_grad():
                val = loss_on(*next(val_batches)).item()
            elapsed = time.perf_counter() - start
            print(f"step {step:5d}  train {loss.item():.3f}  val {val:.3f}  "
                  f"{(step + 1) * args.batch * args.seqlen / elapsed:,.0f} tok/s")

    torch.save(model.state_dict(), args.out)
    model.eval()
    prompt = val_data[: args.seqlen // 4].unsqueeze(0).to(device)
    with autocast:  # learned positions: at most seqlen tokens
        sample = model.generate(prompt, max_length=args.seqlen, top_k=10, temperature=0.8)
    print(bytes(sample[0].tolist()).decode(errors="replace"))


if __name__ == "__main__":
    main()
