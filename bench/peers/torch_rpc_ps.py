#!/usr/bin/env python3
"""The PyTorch peer of `dtrain-bench ps`: a parameter server on torch.distributed.rpc (TensorPipe).

Processes: ps tasks ps0..ps{P-1} hold one shard each of a float32 vector of --size bytes; W workers loop
for --seconds: pull every shard (rpc_async to all ps, then wait) and push a gradient to every shard (the
server applies SGD under a lock), exactly the round trip dtrain's ps-worker times. Prints one JSON line:
round trips/sec and bytes/sec (pulled + pushed) summed over the workers.

  python3 torch_rpc_ps.py --ps 1 --workers 2 --size 1048576 --seconds 2
"""
import argparse, json, os, socket, threading, time

import torch
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp

SHARD = None
LOCK = threading.Lock()


def init_shard(n):
    global SHARD
    SHARD = torch.zeros(n)


def pull():
    with LOCK:
        return SHARD.clone()


def push(grad, lr):
    with LOCK:
        SHARD.sub_(grad, alpha=lr)


def run(rank, a, port, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    world = a.ps + a.workers
    name = f"ps{rank}" if rank < a.ps else f"worker{rank - a.ps}"
    opts = rpc.TensorPipeRpcBackendOptions(num_worker_threads=8, rpc_timeout=120, _transports=["uv"])
    rpc.init_rpc(name, rank=rank, world_size=world, rpc_backend_options=opts)
    if rank == a.ps:  # the first worker creates the shards
        elems = max(a.size // 4, 1)
        per = [elems // a.ps + (1 if i < elems % a.ps else 0) for i in range(a.ps)]
        for i in range(a.ps):
            rpc.rpc_sync(f"ps{i}", init_shard, args=(per[i],))
    if rank >= a.ps:
        while True:  # wait until every shard exists
            try:
                shapes = [rpc.rpc_sync(f"ps{i}", pull).numel() for i in range(a.ps)]
                break
            except Exception:
                time.sleep(0.05)
        grads = [torch.ones(n) for n in shapes]

        def step():
            futs = [rpc.rpc_async(f"ps{i}", pull) for i in range(a.ps)]
            for f in futs:
                f.wait()
            futs = [rpc.rpc_async(f"ps{i}", push, args=(grads[i], 1e-6)) for i in range(a.ps)]
            for f in futs:
                f.wait()

        for _ in range(3):
            step()
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < a.seconds:
            step()
            n += 1
        elapsed = time.perf_counter() - t0
        queue.put((n / elapsed, 2 * 4 * sum(shapes) * n / elapsed))
    rpc.shutdown()  # waits for every task


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ps", type=int, default=1)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--size", type=int, default=4096)
    p.add_argument("--seconds", type=float, default=2)
    a = p.parse_args()
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=run, args=(r, a, port, queue)) for r in range(a.ps + a.workers)]
    for pr in procs:
        pr.start()
    results = [queue.get(timeout=300) for _ in range(a.workers)]
    for pr in procs:
        pr.join(timeout=120)
    print(json.dumps({"round_trips_per_sec": sum(r[0] for r in results), "bytes_per_sec": sum(r[1] for r in results),
                      "variable_bytes": a.size}))


if __name__ == "__main__":
    main()
