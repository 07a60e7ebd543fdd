#!/usr/bin/env python3
"""PyTorch eager on one GPU, set beside dtrain's examples in bench/gpu/run.sh.

resnet50: Horovod's synthetic benchmark without Horovod (torchvision resnet50(), one fixed random batch,
SGD lr 0.01, cross-entropy); prints images/sec over --iters x --batches timed batches after --warmup.
gpt: bench/gpt/torch_gpt.py's GPT (nanoGPT's layout, the model examples/gpt builds) with AdamW on random
token windows; prints tokens/sec.
--math fp32: TF32 off for cuBLAS and cuDNN (dtrain's float32: CUBLAS_DEFAULT_MATH, CUDNN_FMA_MATH);
tf32: PyTorch's defaults (cuDNN convolutions on TF32); bf16: autocast(bfloat16).
The last line is one JSON object; peak_mb is torch.cuda.max_memory_reserved().
"""
import argparse, json, os, sys, time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "gpt"))


def main():
    a = argparse.ArgumentParser()
    a.add_argument("model", choices=["resnet50", "gpt"])
    a.add_argument("--batch-size", type=int, default=32)
    a.add_argument("--math", choices=["fp32", "tf32", "bf16"], default="fp32")
    a.add_argument("--warmup", type=int, default=5)
    a.add_argument("--batches", type=int, default=10)
    a.add_argument("--iters", type=int, default=3)
    a.add_argument("--context", type=int, default=1024)
    a.add_argument("--layers", type=int, default=12)
    a.add_argument("--dim", type=int, default=768)
    a.add_argument("--heads", type=int, default=12)
    a.add_argument("--vocab", type=int, default=50257)
    a.add_argument("--profile", metavar="FILE",
                   help="after timing, profile one more step with torch.profiler and write its GPU "
                        "kernels (name, count, total us) to FILE, as JSON lines")
    args = a.parse_args()
    strict = args.math == "fp32"
    torch.backends.cuda.matmul.allow_tf32 = not strict
    torch.backends.cudnn.allow_tf32 = not strict
    torch.backends.cudnn.benchmark = True
    dev = torch.device("cuda")
    torch.manual_seed(0)
    if args.model == "resnet50":
        import torchvision
        model = torchvision.models.resnet50().to(dev)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        x = torch.rand(args.batch_size, 3, 224, 224, device=dev)
        y = torch.randint(0, 1000, (args.batch_size,), device=dev)
        per_step = args.batch_size

        def step():
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", torch.bfloat16, enabled=args.math == "bf16"):
                loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
    else:
        from torch_gpt import GPT
        model = GPT(args.vocab, args.context, args.layers, args.dim, args.heads).to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
        ids = torch.randint(0, args.vocab, (args.batch_size, args.context + 1), device=dev)
        per_step = args.batch_size * args.context

        def step():
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", torch.bfloat16, enabled=args.math == "bf16"):
                logits = model(ids[:, :-1])
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                       ids[:, 1:].reshape(-1))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
    model.train()
    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    rates = []
    for _ in range(args.iters):
        t0 = time.perf_counter()
        for _ in range(args.batches):
            step()
        torch.cuda.synchronize()
        rates.append(args.batches * per_step / (time.perf_counter() - t0))
    rates.sort()
    if args.profile:
        from torch.profiler import profile, ProfilerActivity
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        with open(args.profile, "w") as f:
            for e in prof.key_averages():
                us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
                if us > 0:
                    f.write(json.dumps({"kernel": e.key, "count": e.count, "us": us}) + "\n")
    print(json.dumps({"system": "pytorch " + torch.__version__, "model": args.model, "math": args.math,
                      "batch": args.batch_size, "per_sec": rates[len(rates) // 2],
                      "unit": "img/s" if args.model == "resnet50" else "tokens/s",
                      "peak_mb": torch.cuda.max_memory_reserved() / 2**20,
                      "gpu": torch.cuda.get_device_name()}))


if __name__ == "__main__":
    main()
