#!/usr/bin/env python3
"""PyTorch's answers to optimizer-state memory on the GPT dtrain's examples/gpt trains (bench/gpt/torch_gpt.py's
model), for bench/zero/memory.py: N processes over gloo on 127.0.0.1, each training `--steps` steps of a batch
of random tokens with AdamW (betas 0.9/0.95, eps 1e-8, weight decay 0.1) under

  ddp   DistributedDataParallel, whole torch.optim.AdamW on every rank (dtrain's sharding none)
  zero  DDP + torch.distributed.optim.ZeroRedundancyOptimizer(AdamW)  (ZeRO-1: dtrain's optimizer_state)
  fsdp  FullyShardedDataParallel(SHARD_GRAD_OP) on the CPU            (ZeRO-2: dtrain's gradients)
  fsdp3 FullyShardedDataParallel(FULL_SHARD), one unit per block       (ZeRO-3: dtrain's parameters)

--recompute: every block under torch.utils.checkpoint (dtrain's --recompute).

Each rank prints one JSON line: its peak RSS, the optimizer state it holds and the seconds per step.

  torch_zero_gpt.py --mode zero --nproc 2 --layers 12 --dim 768 --heads 12 --vocab 50257 --context 64 --batch 1
"""
import argparse, json, os, resource, sys, time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "gpt"))
from torch_gpt import GPT  # noqa: E402


def state_bytes(opt):
    seen, total = set(), 0
    states = opt.optim.state if hasattr(opt, "optim") else opt.state
    for st in states.values():
        for v in st.values():
            if torch.is_tensor(v) and v.numel() > 1 and id(v) not in seen:
                seen.add(id(v))
                total += v.numel() * v.element_size()
    return total


def worker(rank, a, port):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(a.threads)
    dist.init_process_group("gloo", rank=rank, world_size=a.nproc)
    torch.manual_seed(1)
    model = GPT(a.vocab, a.context, a.layers, a.dim, a.heads)
    if a.recompute:
        from torch.utils.checkpoint import checkpoint
        for blk in model.h:
            blk.forward = lambda x, f=blk.forward: checkpoint(f, x, use_reentrant=False)
    kw = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    if a.mode in ("fsdp", "fsdp3"):
        import functools
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
        from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
        from torch_gpt import Block
        full = a.mode == "fsdp3"
        model = FSDP(model, sharding_strategy=ShardingStrategy.FULL_SHARD if full else ShardingStrategy.SHARD_GRAD_OP,
                     auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
                     if full else None, device_id=torch.device("cpu"), use_orig_params=True)
        opt = torch.optim.AdamW(model.parameters(), **kw)
    else:
        model = torch.nn.parallel.DistributedDataParallel(model)
        if a.mode == "zero":
            from torch.distributed.optim import ZeroRedundancyOptimizer
            opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, **kw)
        else:
            opt = torch.optim.AdamW(model.parameters(), **kw)
    g = torch.Generator().manual_seed(rank)
    times = []
    for _ in range(a.steps):
        ids = torch.randint(0, 256, (a.batch, a.context + 1), generator=g)
        t0 = time.perf_counter()
        logits = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if a.mode.startswith("fsdp"):
            model.clip_grad_norm_(1.0)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        times.append(time.perf_counter() - t0)
    print(json.dumps({"system": "pytorch " + torch.__version__, "mode": a.mode, "recompute": a.recompute, "workers": a.nproc, "rank": rank,
                      "optimizer_state_mb": state_bytes(opt) / 2**20,
                      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "seconds_per_step": sorted(times[1:] or times)[len(times[1:] or times) // 2]}), flush=True)
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["ddp", "zero", "fsdp", "fsdp3"], required=True)
    p.add_argument("--recompute", action="store_true")
    for name, default in (("nproc", 2), ("layers", 12), ("dim", 768), ("heads", 12), ("vocab", 50257),
                          ("context", 64), ("batch", 1), ("steps", 3), ("threads", 1), ("port", 29611)):
        p.add_argument("--" + name, type=int, default=default)
    a = p.parse_args()
    mp.spawn(worker, args=(a, a.port), nprocs=a.nproc, join=True)


if __name__ == "__main__":
    main()
