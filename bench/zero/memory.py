#!/usr/bin/env python3
"""Optimizer-state sharding, measured: GPT-2 small (the gpt2 preset, 124M parameters, context 64, one window
per worker a step, AdamW) under dtrain's MultiWorkerMirrored with --sharding none / optimizer_state (ZeRO-1) /
gradients (ZeRO-2) / parameters (ZeRO-3), and PyTorch DDP / ZeroRedundancyOptimizer / FSDP(SHARD_GRAD_OP) /
FSDP(FULL_SHARD, a unit per block) over gloo, at 1, 2 and 4 workers on this machine (--recompute: every
block recomputed in both). Per worker (the largest over the workers): the optimizer state held, the
allocator's peak (dtrain) and the peak RSS; and seconds per step (noisy: 4 processes share 2 cores).

  bench/zero/memory.py --build build --python build/peers-venv/bin/python [--workers 1,2,4] [--recompute]
                       [--json out.jsonl]
"""
import argparse, json, os, subprocess, sys


def dtrain_row(build, workers, sharding, steps, recompute):
    cmd = [os.path.join(build, "tools", "dtrain-run"), "-np", str(workers), "--timeout", "900", "--",
           os.path.join(build, "examples", "gpt"), "--strategy=multi_worker_mirrored", "--preset", "gpt2",
           "--context", "64", "--batch-size", str(workers), "--steps", str(steps), "--steps-per-epoch", str(steps),
           "--val-windows", "1", "--sharding", sharding, "--threads", "1", "--json"]
    if recompute:
        cmd.append("--recompute")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1000)
    if r.returncode != 0:
        return {"error": (r.stdout + r.stderr)[-400:]}
    rows = [json.loads(l.split("] ", 1)[-1]) for l in r.stdout.splitlines() if '"allocator_peak_mb"' in l]
    return {k: max(x[k] for x in rows) for k in ("optimizer_state_mb", "allocator_peak_mb", "peak_rss_mb",
                                                   "seconds_per_step")}


def torch_row(python, workers, mode, steps, recompute):
    here = os.path.dirname(os.path.abspath(__file__))
    cmd = [python, os.path.join(here, "torch_zero_gpt.py"), "--mode", mode, "--nproc", str(workers),
           "--steps", str(steps)] + (["--recompute"] if recompute else [])
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1000)
    rows, dec, text, at = [], json.JSONDecoder(), r.stdout, r.stdout.find("{")
    while at >= 0:  # ranks print concurrently: objects may share a line
        obj, end = dec.raw_decode(text, at)
        rows.append(obj)
        at = text.find("{", end)
    if r.returncode != 0 or len(rows) != workers:
        return {"error": (r.stdout + r.stderr).strip().splitlines()[-1][:300] if (r.stdout + r.stderr).strip() else "?"}
    return {k: max(x[k] for x in rows) for k in ("optimizer_state_mb", "peak_rss_mb", "seconds_per_step")}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--build", default="build")
    p.add_argument("--python", default=sys.executable, help="a Python with torch (bench/peers/setup.sh)")
    p.add_argument("--workers", default="1,2,4")
    p.add_argument("--steps", type=int, default=7, help="dtrain times the steps after its 5 warm-up steps")
    p.add_argument("--json")
    p.add_argument("--recompute", action="store_true")
    a = p.parse_args()
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    print(f"CPU: {cpu}, {os.cpu_count()} cores; GPT-2 small (124M), context 64, AdamW, per worker"
          + (", every block recomputed" if a.recompute else ""))
    print(f"{'system':<34}{'workers':>8}{'opt. state MB':>15}{'alloc. peak MB':>16}{'peak RSS MB':>13}{'s/step':>8}")
    out = open(a.json, "w") if a.json else None
    for n in [int(x) for x in a.workers.split(",")]:
        runs = [("dtrain " + s, lambda s=s: dtrain_row(a.build, n, s, a.steps, a.recompute))
                for s in ("none", "optimizer_state", "gradients", "parameters")]
        runs += [("pytorch " + m, lambda m=m: torch_row(a.python, n, m, a.steps, a.recompute))
                 for m in ("ddp", "zero", "fsdp", "fsdp3")]
        for name, fn in runs:
            r = fn()
            r.update({"system": name, "workers": n, "cpu": cpu, "recompute": a.recompute})
            if out:
                out.write(json.dumps(r) + "\n")
            if "error" in r:
                print(f"{name:<34}{n:>8}  failed: {r['error'][-150:]}")
                continue
            alloc = f"{r['allocator_peak_mb']:>16.0f}" if "allocator_peak_mb" in r else f"{'-':>16}"
            print(f"{name:<34}{n:>8}{r['optimizer_state_mb']:>15.0f}{alloc}{r['peak_rss_mb']:>13.0f}"
                  f"{r['seconds_per_step']:>8.2f}", flush=True)


if __name__ == "__main__":
    main()
