#!/usr/bin/env python3
"""Cross-worker gradient compression under MultiWorkerMirrored (dtrain-run -np 2, TCP ring on the
loopback device, DTRAIN_SHARED_MEMORY=0): the bytes on the wire, counted by the kernel
(/proc/net/dev, interface lo), halve with --compression=fp16 and bf16, and the 40-step training loss
stays within 1e-3 (fp16) and 5e-3 (bf16) of the uncompressed run's while differing from it (the
rounding is applied). With shared memory on (the default on one host) almost nothing crosses the
loopback device. A bad --compression is refused.

  compression_test.py DTRAIN_RUN FASHION_MNIST
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
    short = ["--steps=40", "--no-eval", "--train-limit=4000", "--batch-size=64"]
    sizes, losses = {}, {}
    for c in ("none", "fp16", "bf16"):
        sizes[c], j = run(base + short + [f"--compression={c}"])
        losses[c] = j["final_loss"]
        print(f"{c}: {sizes[c] / 1e6:.1f} MB over loopback for 40 steps, final loss {losses[c]:.8f}")
    # The gradients rounded to 11 (fp16) or 8 (bf16) significant bits before the sum: the loss over
    # 40 steps moves by about 1e-5 and 2e-4 of itself (measured); a compressed sum that is scaled,
    # truncated or summed wrongly moves it by far more.
    for c, bound in (("fp16", 1e-3), ("bf16", 5e-3)):
        rel = abs(losses[c] - losses["none"]) / losses["none"]
        if rel > bound or losses[c] == losses["none"]:
            sys.exit(f"{c}: the 40-step loss is {rel:.3g} away from float32's (expected > 0 and <= {bound})")
        print(f"ok: {c} loss {rel:.2g} from float32's")
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
