#!/usr/bin/env python3
"""PyTorch's side of `dtrain-bench compare --model gpt2`: the GPT of bench/gpt/torch_gpt.py (nanoGPT's
layout, the model examples/gpt builds: learned positions, pre-norm blocks, tanh-GELU MLP, tied head)
trained on random byte windows with AdamW (betas 0.9/0.95, weight decay 0.1 on the kernels) and
global-norm clipping at 1, on the CPU; prints tokens per second.

  python bench/gpt/peer_gpt.py [--layers 12 --dim 768 --heads 12 --vocab 50257] [--context 256]
      [--batch-size 4] [--threads 1] [--warmup 1] [--steps 3] [--precision fp32|bf16] [--compile]
      [--workers N] [--json]

--compile: torch.compile(model) (Inductor; its compilation runs in the warm-up steps, not timed).
--precision bf16: torch.autocast("cpu", bfloat16) around the forward pass and the loss.
--workers N: N processes started by this script, one core each where there are enough (taskset),
--batch-size windows each, under DistributedDataParallel over gloo.
The last line is one JSON object: tokens_per_sec (the whole job's), seconds_per_step and peak_rss_mb
(the largest process).
"""
import argparse, json, os, resource, sys, time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
from tf_fashion_mnist import free_ports, run_workers  # noqa: E402 (bench/: imports no framework at load)


def main():
    a = argparse.ArgumentParser()
    for name, default in (("layers", 12), ("dim", 768), ("heads", 12), ("vocab", 50257), ("context", 256),
                          ("batch-size", 4), ("threads", 1), ("warmup", 1), ("steps", 3), ("workers", 1)):
        a.add_argument("--" + name, type=int, default=default)
    a.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    a.add_argument("--compile", action="store_true")
    a.add_argument("--worker-index", type=int, default=-1, help=argparse.SUPPRESS)
    a.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    a.add_argument("--master-addr", default="127.0.0.1",
                   help="with --worker-index and --port: rank 0's address (bench/links/links.py starts each "
                   "worker on its own netns host)")
    a.add_argument("--json", action="store_true")
    args = a.parse_args()
    if args.workers > 1 and args.worker_index < 0:
        return launch_workers(args)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch
    import torch.nn.functional as F
    sys.path.insert(0, HERE)
    from torch_gpt import GPT
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = GPT(args.vocab, args.context, args.layers, args.dim, args.heads)
    decay = [p for n, p in model.named_parameters()
             if n.endswith("weight") and "ln" not in n and "wte" not in n and "wpe" not in n]
    other = [p for p in model.parameters() if not any(p is q for q in decay)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                            lr=1e-4, betas=(0.9, 0.95), eps=1e-8)
    if args.workers > 1:
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method=f"tcp://{args.master_addr}:{args.port}",
                                rank=args.worker_index, world_size=args.workers)
        model = torch.nn.parallel.DistributedDataParallel(model)
    run = torch.compile(model) if args.compile else model
    gen = torch.Generator().manual_seed(1 + max(0, args.worker_index))
    bf16 = args.precision == "bf16"

    def step():
        w = torch.randint(0, 256, (args.batch_size, args.context + 1), generator=gen)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = run(w[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), w[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss.item()

    for _ in range(args.warmup):
        step()
    t0 = time.perf_counter()
    for i in range(args.steps):
        step()
    secs = (time.perf_counter() - t0) / args.steps
    out = {"system": "pytorch " + torch.__version__ + (" compile" if args.compile else " eager"),
           "precision": args.precision, "batch_size": args.batch_size, "context": args.context,
           "threads": args.threads, "seconds_per_step": secs,
           "tokens_per_sec": args.batch_size * args.context / secs,
           "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0}
    print(json.dumps(out) if args.json else out, flush=True)


def launch_workers(args):
    """Starts --workers copies of this script, one core each where there are enough; prints the job's rate."""
    port = free_ports(1)[0]
    results = run_workers(__file__, sys.argv[1:] + [f"--port={port}"], args.workers, args.threads)
    out = dict(results[0])
    out["workers"] = args.workers
    out["tokens_per_sec"] = sum(r["tokens_per_sec"] for r in results)
    out["seconds_per_step"] = max(r["seconds_per_step"] for r in results)
    out["peak_rss_mb"] = max(r["peak_rss_mb"] for r in results)
    print(json.dumps(out) if args.json else out, flush=True)


if __name__ == "__main__":
    main()
