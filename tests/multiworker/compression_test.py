#!/usr/bin/env python3
"""Cross-worker gradient compression under MultiWorkerMirrored (dtrain-run -np 2, TCP ring on the
loopback device, DTRAIN_SHARED_MEMORY=0): the bytes on the wire, counted by the kernel
(/proc/net/dev, interface lo), halve with --compression=fp16 and bf16. With shared memory on (the
default on one host) almost nothing crosses the loopback device. With --accuracy: test accuracy
after 5 epochs within 0.3 points of no compression.

  compression_test.py DTRAIN_RUN FASHION_MNIST [--accuracy]
"""
import json, os, subprocess, sys

SOCKETS = dict(os.environ, DTRAIN_SHARED_MEMORY="0")

def lo_bytes():
    with open("/proc/net/dev") as f:
        for line in f:
            if line.strip().startswith("lo:"):
                return int(line.split(":", 1)[1].split()[8])  # transmit bytes
    sys.exit("no loopback interface in /proc/net/dev")

def run(cmd, env=SOCKETS):
    before = lo_bytes()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    after = lo_bytes()
    if r.returncode != 0:
        sys.exit(f"failed ({r.returncode}): {' '.join(cmd)}\n{r.stdout}\n{r.stderr}")
    j = json.loads([l.split("] ", 1)[-1] for l in r.stdout.splitlines() if '"final_loss"' in l][-1])
    return after - before, j

def main():
    dtrain_run, binary = sys.argv[1], sys.argv[2]
    base = [dtrain_run, "-np", "2", "--", binary, "--strategy=multi_worker_mirrored", "--json", "--seed=9"]
    if "--accuracy" in sys.argv:
        accs = {}
        for c in ("none", "fp16", "bf16"):
            _, j = run(base + ["--epochs=5", f"--compression={c}"])
            accs[c] = j["test_accuracy"]
            print(f"{c}: test accuracy {accs[c]:.4f}")
        for c in ("fp16", "bf16"):
            if abs(accs[c] - accs["none"]) > 0.003:
                sys.exit(f"{c} compression changes the test accuracy by more than 0.3 points: {accs}")
        print("ok: fp16 and bf16 within 0.3 points of float32")
        return
    short = ["--steps=40", "--no-eval", "--train-limit=4000", "--batch-size=64"]
    sizes = {}
    for c in ("none", "fp16", "bf16"):
        sizes[c], j = run(base + short + [f"--compression={c}"])
        print(f"{c}: {sizes[c] / 1e6:.1f} MB over loopback for 40 steps, final loss {j['final_loss']:.4f}")
    # The reference CNN has 225,034 float32 parameters: 40 all-reduces of 0.9 MB on a 2-rank ring.
    for c in ("fp16", "bf16"):
        ratio = sizes[c] / sizes["none"]
        if not 0.45 <= ratio <= 0.6:
            sys.exit(f"{c}: {ratio:.3f} of the uncompressed bytes; expected about one half")
        print(f"ok: {c} sends {ratio:.3f} of the bytes")
    shm, _ = run(base + short + ["--compression=none"], env=dict(os.environ, DTRAIN_SHARED_MEMORY="1"))
    print(f"shared memory: {shm / 1e6:.2f} MB over loopback for 40 steps")
    if shm > 0.1 * sizes["none"]:
        sys.exit(f"with shared memory {shm} bytes crossed the loopback device, {shm / sizes['none']:.2f} of the TCP ring's")
    print("ok: with shared memory the gradients do not cross the loopback device")
    r = subprocess.run(base + short + ["--compression=int4"], capture_output=True, text=True, timeout=120)
    if r.returncode == 0 or "none, fp16, bf16" not in r.stdout + r.stderr:
        sys.exit(f"a bad --compression was not refused:\n{r.stdout}{r.stderr}")
    print("ok: --compression=int4 is refused")

if __name__ == "__main__":
    main()
