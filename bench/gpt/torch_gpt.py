#!/usr/bin/env python3
"""The anchor for examples/gpt: the same byte-level GPT written in PyTorch (as nanoGPT writes it), trained
on the same token file, the same windows in the same order, with the same initialisation scheme,
optimizer, schedule and steps, so its validation loss can be set beside dtrain's.

Matches `build/examples/gpt --window-order=consecutive`: training windows of T + 1 bytes at 0, T, 2T, ... of
the first 90% of the file, batch k being windows [kB, (k+1)B); validation on the first V windows of the
last 10%, after each epoch of S steps. Model: token + learned position embeddings, pre-norm blocks
(LayerNorm eps 1e-5, causal self-attention with q, k, v and output projections with biases, MLP 4D with
tanh-GELU), final LayerNorm, head tied to the token embedding; normal(0, 0.02) weights, residual
projections normal(0, 0.02/sqrt(2L)), zero biases. AdamW (betas 0.9/0.95, eps 1e-8, weight decay on
kernels only), global-norm clipping at 1, Keras' CosineDecay with warm-up from lr/(W+1) to lr over W
steps, then cosine to lr/10. Writes a CSV (epoch,loss,val_loss) as dtrain's CSVLogger does.

  torch_gpt.py --token-file F --layers 4 --dim 128 --heads 4 --context 128 --batch-size 32 \\
               --epochs 3 --steps-per-epoch 200 --val-windows 256 --lr 1e-3 --warmup-steps 100 --csv out.csv
"""
import argparse, csv, json, math, sys, time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d, h, layers):
        super().__init__()
        self.h = h
        self.ln_1, self.ln_2 = nn.LayerNorm(d, eps=1e-5), nn.LayerNorm(d, eps=1e-5)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.fc, self.proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        for lin in (self.q, self.k, self.v, self.fc):
            nn.init.normal_(lin.weight, 0.0, 0.02)
        for lin in (self.o, self.proj):
            nn.init.normal_(lin.weight, 0.0, 0.02 / math.sqrt(2 * layers))
        for lin in (self.q, self.k, self.v, self.o, self.fc, self.proj):
            nn.init.zeros_(lin.bias)

    def forward(self, x):
        b, t, d = x.shape
        y = self.ln_1(x)
        q, k, v = (p(y).view(b, t, self.h, d // self.h).transpose(1, 2) for p in (self.q, self.k, self.v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.h)
        att = att.masked_fill(torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
        y = (att.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.o(y)
        return x + self.proj(F.gelu(self.fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, vocab, context, layers, d, h):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(context, d)
        nn.init.normal_(self.wte.weight, 0.0, 0.02)
        nn.init.normal_(self.wpe.weight, 0.0, 0.02)
        self.h = nn.ModuleList(Block(d, h, layers) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d, eps=1e-5)

    def forward(self, ids):
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        for b in self.h:
            x = b(x)
        return self.ln_f(x) @ self.wte.weight.t()  # the tied head


def lr_at(step, lr, warmup, total):
    """Keras' CosineDecay(lr / (W + 1), total - W, alpha 0.1, warmup_target lr, W), step 0-based."""
    initial = lr / (warmup + 1)
    if step < warmup:
        return initial + (lr - initial) * step / warmup
    s = min(step - warmup, total - warmup)
    return lr * (0.9 * 0.5 * (1 + math.cos(math.pi * s / (total - warmup))) + 0.1)


def main():
    a = argparse.ArgumentParser()
    a.add_argument("--token-file", required=True)
    for name, default in (("layers", 4), ("dim", 128), ("heads", 4), ("context", 128), ("batch-size", 32),
                          ("epochs", 3), ("steps-per-epoch", 200), ("val-windows", 256), ("warmup-steps", 100),
                          ("seed", 42), ("threads", 2)):
        a.add_argument("--" + name, type=int, default=default)
    a.add_argument("--lr", type=float, default=1e-3)
    a.add_argument("--weight-decay", type=float, default=0.1)
    a.add_argument("--csv", required=True)
    o = a.parse_args()
    torch.manual_seed(o.seed)
    torch.set_num_threads(o.threads)
    data = np.fromfile(o.token_file, dtype=np.uint8).astype(np.int64)
    split = len(data) * 9 // 10
    t = o.context

    def windows(begin, first, count):
        idx = begin + (first + np.arange(count))[:, None] * t + np.arange(t + 1)[None, :]
        w = torch.from_numpy(data[idx])
        return w[:, :-1], w[:, 1:]

    model = GPT(256, o.context, o.layers, o.dim, o.heads)
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and "ln" not in n and "wte" not in n and "wpe" not in n]
    other = [p for n, p in model.named_parameters() if not any(p is q for q in decay)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay}, {"params": other, "weight_decay": 0.0}],
                            lr=o.lr, betas=(0.9, 0.95), eps=1e-8)
    total = o.epochs * o.steps_per_epoch
    warm = min(o.warmup_steps, total // 2)
    vx, vy = windows(split, 0, o.val_windows)
    rows, step, start = [], 0, time.time()
    for epoch in range(o.epochs):
        losses = []
        for _ in range(o.steps_per_epoch):
            for g in opt.param_groups:
                g["lr"] = lr_at(step, o.lr, warm, total)
            x, y = windows(0, step * o.batch_size, o.batch_size)
            loss = F.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses.append(loss.item())
            step += 1
        with torch.no_grad():
            val = sum(F.cross_entropy(model(vx[i:i + o.batch_size]).reshape(-1, 256), vy[i:i + o.batch_size].reshape(-1),
                                      reduction="sum").item() for i in range(0, o.val_windows, o.batch_size))
            val /= o.val_windows * t
        rows.append((epoch, sum(losses) / len(losses), val))
        print(f"epoch {epoch + 1}: loss {rows[-1][1]:.4f} - val_loss: {val:.4f} ({val / math.log(2):.4f} bits/byte)",
              flush=True)
    with open(o.csv, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["epoch", "loss", "val_loss"])
        w.writerows(rows)
    print(json.dumps({"torch": torch.__version__, "parameters": sum(p.numel() for p in model.parameters()),
                      "steps": step, "val_loss_nats": rows[-1][2], "seconds": time.time() - start}))


if __name__ == "__main__":
    main()
