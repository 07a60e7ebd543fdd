#!/usr/bin/env python3
"""Step time with and without sharded optimizer state: examples/gpt under MultiWorkerMirrored with --sharding
none / optimizer_state / gradients / parameters, in interleaved rounds, medians of seconds per step (each run times the
steps after its 5 warm-up steps). On loopback (127.0.0.1) or, with --netns PREFIX, on network-namespace test
hosts made by `tools/netns/dtrain-netns up --hosts N --rate 1gbit` (one worker per host).

  bench/zero/speed.py --build build --workers 2 --rounds 3 [--netns dtn] [--preset gpt2 --context 64]
                      [--modes none,gradients,parameters] [--recompute]

--recompute runs every mode with each transformer block recomputed (ZeRO-3 then gathers each block's
weights again for the backward pass, FSDP's reshard_after_forward).
"""
import argparse, json, os, statistics, subprocess


def run(a, sharding):
    cmd = [os.path.join(a.build, "tools", "dtrain-run")]
    if a.netns:
        cmd += ["--netns", a.netns]
    cmd += ["-np", str(a.workers), "--timeout", "900", "--", os.path.join(a.build, "examples", "gpt"),
            "--strategy=multi_worker_mirrored", "--preset", a.preset, "--context", str(a.context),
            "--batch-size", str(a.workers * a.batch_per_worker), "--steps", str(a.steps), "--steps-per-epoch",
            str(a.steps), "--val-windows", "1", "--sharding", sharding, "--threads", "1", "--json"]
    if a.recompute:
        cmd.append("--recompute")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    rows = [json.loads(l.split("] ", 1)[-1]) for l in r.stdout.splitlines() if '"seconds_per_step"' in l]
    if r.returncode != 0 or not rows:
        raise SystemExit(f"{' '.join(cmd)} failed ({r.returncode}):\n{(r.stdout + r.stderr)[-2000:]}")
    return rows[0]["seconds_per_step"]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--build", default="build")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--preset", default="gpt2")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--batch-per-worker", type=int, default=1)
    p.add_argument("--netns", default="")
    p.add_argument("--modes", default="none,optimizer_state,gradients,parameters")
    p.add_argument("--recompute", action="store_true")
    a = p.parse_args()
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    modes = a.modes.split(",")
    if modes[0] != "none":
        raise SystemExit("--modes: the first must be none (the baseline)")
    times = {m: [] for m in modes}
    for r in range(a.rounds):
        for m in modes:
            times[m].append(run(a, m))
            print(f"round {r + 1}: {m}: {times[m][-1]:.3f} s/step", flush=True)
    where = f"netns hosts {a.netns}*" if a.netns else "loopback"
    print(f"CPU: {cpu}; {a.workers} workers on {where}; {a.preset}, context {a.context}, "
          f"{a.batch_per_worker} window(s) per worker{', recompute' if a.recompute else ''}; medians of "
          f"{a.rounds} interleaved rounds")
    base = statistics.median(times["none"])
    for m in modes:
        med = statistics.median(times[m])
        print(f"  sharding {m:<16} {med:7.3f} s/step  ({med / base:.3f}x unsharded)  rounds: "
              + ", ".join(f"{t:.3f}" for t in times[m]))


if __name__ == "__main__":
    main()
