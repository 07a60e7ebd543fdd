#!/usr/bin/env python3
"""The largest GPT that trains in a fixed memory budget per worker: examples/gpt (width 768, 12 heads, the
gpt2 preset's vocabulary of 50,257; only the number of layers varies) under MultiWorkerMirrored with N workers,
each worker in a memory cgroup of its own limited to --budget-mb (bench/zero/in_memory_budget.sh; needs root,
the machine has no swap, so going over kills the worker). For each of sharding none / optimizer_state /
gradients / parameters (--modes), without and with --recompute, a binary search over the layers finds the deepest model that trains
--steps steps; prints it with its parameter count.

  bench/zero/budget.py --build build --workers 2 --budget-mb 2048 --context 128 [--max-layers 48] [--cache-mb 0]
"""
import argparse, glob, json, os, subprocess, sys

HERE = os.path.dirname(os.path.abspath(__file__))


def trains(a, layers, sharding, recompute):
    cmd = [os.path.join(a.build, "tools", "dtrain-run"), "-np", str(a.workers), "--timeout", "600", "--",
           os.path.join(HERE, "in_memory_budget.sh"), str(a.budget_mb),
           os.path.join(a.build, "examples", "gpt"), "--strategy=multi_worker_mirrored", "--preset", "gpt2",
           "--layers", str(layers), "--context", str(a.context), "--batch-size", str(a.workers),
           "--steps", str(a.steps), "--steps-per-epoch", str(a.steps), "--val-windows", "1",
           "--sharding", sharding, "--threads", "1", "--json"] + (["--recompute"] if recompute else [])
    env = dict(os.environ, DTRAIN_HOST_CACHE_MB=str(a.cache_mb))
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    finally:
        for d in glob.glob("/sys/fs/cgroup/memory/dtrain-budget-*"):
            try:
                os.rmdir(d)
            except OSError:
                pass
    rows = [json.loads(l.split("] ", 1)[-1]) for l in r.stdout.splitlines() if '"parameters"' in l]
    return (r.returncode == 0 and rows), (rows[0] if rows else None)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--build", default="build")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--budget-mb", type=int, default=2048)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--max-layers", type=int, default=48)
    p.add_argument("--cache-mb", type=int, default=2048, help="DTRAIN_HOST_CACHE_MB for the workers")
    p.add_argument("--modes", default="none,optimizer_state,gradients,parameters")
    a = p.parse_args()
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    print(f"CPU: {cpu}; {a.workers} workers, {a.budget_mb} MB each, width 768, context {a.context}, AdamW, "
          f"DTRAIN_HOST_CACHE_MB={a.cache_mb}")
    print(f"{'sharding':<18}{'recompute':>10}{'layers':>8}{'parameters':>14}{'alloc. peak MB':>16}")
    for sharding in a.modes.split(","):
        for recompute in (False, True):
            lo, hi, best = 0, a.max_layers + 1, None  # lo trains (0 = nothing did), hi does not
            while hi - lo > 1:
                mid = (lo + hi) // 2
                ok, row = trains(a, mid, sharding, recompute)
                print(f"  {sharding} recompute={recompute} layers={mid}: {'trains' if ok else 'does not fit'}",
                      file=sys.stderr, flush=True)
                if ok:
                    lo, best = mid, row
                else:
                    hi = mid
            params = f"{best['parameters']:>14,}" if best else f"{'-':>14}"
            peak = f"{best['allocator_peak_mb']:>16.0f}" if best else f"{'-':>16}"
            print(f"{sharding:<18}{str(recompute):>10}{lo:>8}{params}{peak}", flush=True)


if __name__ == "__main__":
    main()
