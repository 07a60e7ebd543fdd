#!/usr/bin/python3
"""PyTorch DistributedDataParallel (gloo, CPU) peer benchmark for dtrain.

Run with the interpreter that has PyTorch installed, e.g.:

    /usr/bin/python3 bench/torch_ddp_fashion_mnist.py --nproc 2 --steps 300 --json

Spawns --nproc worker processes with torch.multiprocessing (spawn start
method) that form a gloo process group on 127.0.0.1 (a free port). Each rank
runs --threads-per-proc intra-/inter-op threads and trains the same model as
bench/torch_fashion_mnist.py (identical to dtrain's reference model; Adam
lr=1e-3, eps=1e-7 to match Keras) on its shard of the data: every epoch the
full training set is shuffled with a seed shared by all ranks and rank r takes
the shuffled positions i with i % nproc == r (DistributedSampler-like, dropping
the uneven tail). The per-replica batch is --batch-size, so the global batch
is batch_size * nproc.

Timing: after --warmup untimed steps every rank hits a barrier and starts its
clock; after the timed steps every rank hits another barrier and stops it.
Aggregate images/sec = nproc * batch * timed_steps / (max wall time over
ranks).
"""

import argparse
import datetime
import json
import os
import resource
import socket
import sys
import time

try:
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP
except ImportError:  # pragma: no cover - depends on the interpreter
    sys.stderr.write(
        "error: PyTorch is not importable by %s; run this script with an "
        "interpreter that has torch installed (e.g. /usr/bin/python3)\n"
        % sys.executable)
    sys.exit(2)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_fashion_mnist as single  # noqa: E402  (shared data + model code)

INIT_TIMEOUT = datetime.timedelta(seconds=60)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2,
                   help="number of DDP worker processes (default 2)")
    p.add_argument("--threads-per-proc", type=int, default=1,
                   help="torch intra-/inter-op threads per process (default 1)")
    p.add_argument("--batch-size", type=int, default=64,
                   help="per-replica batch size (default 64)")
    p.add_argument("--steps", type=int, default=300,
                   help="timed steps after warmup (default 300)")
    p.add_argument("--warmup", type=int, default=20,
                   help="untimed warmup steps (default 20)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-dir", default=None,
                   help="directory with the gzip IDX files (default %s)"
                        % single.DEFAULT_DATA_DIR)
    p.add_argument("--timeout", type=float, default=1800.0,
                   help="hard wall-clock limit for the whole run in seconds "
                        "(default 1800); workers are killed when exceeded")
    p.add_argument("--json", action="store_true",
                   help="print a final JSON line with the results")
    args = p.parse_args(argv)
    if args.nproc < 1 or args.threads_per_proc < 1 or args.batch_size < 1 \
            or args.steps < 1 or args.warmup < 0:
        p.error("--nproc/--threads-per-proc/--batch-size/--steps must be "
                ">= 1 and --warmup >= 0")
    return args


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank, args, data_dir, port, result_q):
    torch.set_num_threads(args.threads_per_proc)
    try:
        torch.set_num_interop_threads(args.threads_per_proc)
    except RuntimeError:
        pass
    # One share of the cores per process, as dtrain-run gives its workers (torchrun sets only
    # OMP_NUM_THREADS); all cores when there are fewer than processes.
    cores = sorted(os.sched_getaffinity(0))
    per = args.threads_per_proc
    if len(cores) >= args.nproc * per:
        os.sched_setaffinity(0, set(cores[rank * per:(rank + 1) * per]))
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=args.nproc,
                            timeout=INIT_TIMEOUT)
    try:
        nproc = args.nproc
        x_np, y_np = single.load_split(data_dir, "train")
        x_train = torch.from_numpy(x_np)
        y_train = torch.from_numpy(y_np)
        n = x_train.shape[0]
        bs = args.batch_size
        shard_len = n // nproc                   # equal shards, tail dropped
        steps_per_epoch = shard_len // bs        # drop last
        if steps_per_epoch == 0:
            raise ValueError("per-replica batch %d exceeds shard size %d"
                             % (bs, shard_len))

        torch.manual_seed(args.seed)  # same init everywhere; DDP also
        model = DDP(single.build_model())  # broadcasts rank 0's params.
        model.train()
        opt = single.build_optimizer(model)
        loss_fn = nn.CrossEntropyLoss()

        gen = torch.Generator()
        warmup = args.warmup
        total_steps = warmup + args.steps
        shard = None
        t0 = None
        if warmup == 0:
            dist.barrier()
            t0 = time.perf_counter()
        for step in range(total_steps):
            pos = step % steps_per_epoch
            if pos == 0:
                epoch = step // steps_per_epoch
                gen.manual_seed(args.seed + epoch)  # identical on all ranks
                perm = torch.randperm(n, generator=gen)
                shard = perm[rank:nproc * shard_len:nproc]  # i % nproc == rank
            idx = shard[pos * bs:(pos + 1) * bs]
            xb = x_train.index_select(0, idx)
            yb = y_train.index_select(0, idx)

            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(xb), yb)
            loss.backward()               # gradient all-reduce happens here
            opt.step()

            if step + 1 == warmup:
                dist.barrier()
                t0 = time.perf_counter()
        dist.barrier()
        t1 = time.perf_counter()

        stats = torch.tensor([t1 - t0, float(loss.detach())],
                             dtype=torch.float64)
        elapsed = stats[:1].clone()
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        loss_sum = stats[1:].clone()
        dist.all_reduce(loss_sum, op=dist.ReduceOp.SUM)
        rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0], dtype=torch.float64)
        dist.all_reduce(rss, op=dist.ReduceOp.MAX)
        if rank == 0:
            result_q.put({
                "elapsed": float(elapsed[0]),
                "final_loss": float(loss_sum[0]) / nproc,
                "timed_steps": args.steps,
                "warmup": warmup,
                "peak_rss_mb": float(rss[0]),
            })
    finally:
        dist.destroy_process_group()


def main(argv=None):
    args = parse_args(argv)
    data_dir = single.data_dir_from(args.data_dir)
    single.check_data(data_dir, need_test=False)

    ctx = mp.get_context("spawn")
    result_q = ctx.SimpleQueue()
    port = free_port()
    pctx = mp.spawn(worker, args=(args, data_dir, port, result_q),
                    nprocs=args.nproc, join=False)
    deadline = time.monotonic() + args.timeout
    try:
        while not pctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                sys.stderr.write("error: DDP benchmark exceeded --timeout of "
                                 "%g s; killing workers\n" % args.timeout)
                for p in pctx.processes:
                    if p.is_alive():
                        p.kill()
                return 3
    except mp.ProcessRaisedException as e:
        sys.stderr.write("error: a DDP worker failed:\n%s\n" % e)
        return 1
    except mp.ProcessExitedException as e:
        # torch 2.x's gloo sometimes aborts a process while it tears down ("terminate called
        # without an active exception"), after rank 0 has handed over the timed result: keep it.
        if result_q.empty():
            sys.stderr.write("error: a DDP worker exited abnormally: %s\n" % e)
            return 1
        sys.stderr.write("warning: a DDP worker exited abnormally after the timed steps: %s\n" % e)

    if result_q.empty():
        sys.stderr.write("error: rank 0 produced no result\n")
        return 1
    r = result_q.get()
    bs = args.batch_size
    global_batch = bs * args.nproc
    ips = (global_batch * r["timed_steps"] / r["elapsed"]
           if r["elapsed"] > 0 else 0.0)

    print("pytorch-ddp %s gloo: nproc=%d threads_per_proc=%d "
          "batch_per_replica=%d global_batch=%d timed_steps=%d (warmup %d) "
          "time=%.3fs images/sec=%.1f final_loss=%.4f"
          % (torch.__version__, args.nproc, args.threads_per_proc, bs,
             global_batch, r["timed_steps"], r["warmup"], r["elapsed"], ips,
             r["final_loss"]), flush=True)
    if args.json:
        print(json.dumps({
            "framework": "pytorch-ddp",
            "torch_version": torch.__version__,
            "backend": "gloo",
            "nproc": args.nproc,
            "threads_per_proc": args.threads_per_proc,
            "batch_per_replica": bs,
            "global_batch": global_batch,
            "steps": r["timed_steps"],
            "images_per_sec": round(ips, 3),
            "final_loss": r["final_loss"],
            "peak_rss_mb": r["peak_rss_mb"],
        }), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
