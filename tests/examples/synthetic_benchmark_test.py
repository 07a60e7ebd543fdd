#!/usr/bin/env python3
"""examples/synthetic_benchmark prints Horovod's lines, alone and under dtrain-run -np 2 (2 devices in
the total), with --fp16-allreduce, and refuses an unknown model by name.
  synthetic_benchmark_test.py DTRAIN_RUN SYNTHETIC_BENCHMARK
"""
import json, re, subprocess, sys

SMALL = ["--model=resnet18", "--image-size=32", "--batch-size=4", "--num-warmup-batches=1",
         "--num-batches-per-iter=2", "--num-iters=3", "--threads=1", "--json"]


def run(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    return r.returncode, r.stdout, r.stderr


def check(out, devices):
    for pattern in (r"^Iter #2: [0-9.]+ img/sec per device$",
                    r"^Img/sec per device: [0-9.]+ \+-[0-9.]+$",
                    rf"^Total img/sec on {devices} device\(s\): [0-9.]+ \+-[0-9.]+$"):
        if not re.search(pattern, out, re.M):
            sys.exit(f"no line matching {pattern!r} in:\n{out}")
    j = json.loads(out.strip().splitlines()[-1].split("] ", 1)[-1])
    if j["replicas"] != devices or not j["img_sec_per_device"] > 0:
        sys.exit(f"bad JSON: {j}")
    if abs(j["total_img_sec"] - devices * j["img_sec_per_device"]) > 1e-6 * j["total_img_sec"]:
        sys.exit(f"the total is not devices x per device: {j}")
    print(f"ok: {devices} device(s): {j['img_sec_per_device']:.1f} img/sec per device")


def main():
    launcher, bench = sys.argv[1], sys.argv[2]
    code, out, err = run([bench] + SMALL)
    if code != 0:
        sys.exit(f"one device failed ({code}):\n{out}\n{err}")
    check(out, 1)
    code, out, err = run([launcher, "-np", "2", "--timeout", "200", "--", bench,
                          "--strategy=multi_worker_mirrored", "--fp16-allreduce"] + SMALL)
    if code != 0:
        sys.exit(f"dtrain-run -np 2 failed ({code}):\n{out}\n{err}")
    check("\n".join(l.split("] ", 1)[-1] for l in out.splitlines()), 2)
    code, out, err = run([bench, "--model=resnet51"] + SMALL[1:])
    if code == 0 or "unknown model 'resnet51'" not in err:
        sys.exit(f"an unknown model was not refused by name ({code}):\n{err}")
    print("ok: an unknown model is refused by name")


if __name__ == "__main__":
    main()
