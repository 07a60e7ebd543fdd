#!/usr/bin/env python3
"""Sharded optimizer state and gradients (--sharding / DTRAIN_SHARDING, ZeRO-1 and ZeRO-2) under
MultiWorkerMirrored with real processes over TCP on 127.0.0.1.

  sharding_test.py DTRAIN_RUN TRAIN_WEIGHTS FASHION_MNIST

- 2 workers: every weight bitwise equal to the unsharded job (a sum of two addends does not depend on
  the collective's order), SGD with momentum, Adam and AdamW, both stages; each worker holds half the
  optimizer state.
- 4 workers, AdamW with global-norm clipping: within float rounding of the unsharded job (the ring's
  reduce-scatter adds four addends in another order); each worker holds a quarter of the state.
- kill -9 of a worker of a sharded 3-worker job, the command run again: BackupAndRestore resumes and
  the final checkpoint is bitwise that of an uninterrupted sharded run; that checkpoint (slots
  written whole) restores under one_device with the job's own test accuracy, and a truncated copy
  of it is refused with DataLoss.
"""
import json, os, random, subprocess, sys, tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "train"))
from backup_restore_test import children, same, start_and_kill  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import multiworker_test  # noqa: E402


def read_weights(path):
    """The file's bytes, and its tensors (multiworker_test.py's reader)."""
    with open(path, "rb") as f:
        data = f.read()
    return data, multiworker_test.read_weights(path)[1]


def run(cmd, env=None, timeout=400):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if r.returncode != 0:
        sys.exit(f"failed ({r.returncode}): {' '.join(cmd)}\n{r.stdout}{r.stderr}")
    return r.stdout + r.stderr


def slot_elements(out):
    """Per worker: the optimizer slot elements it reported holding."""
    held = {}
    for line in out.splitlines():
        if "optimizer slot elements" in line:
            words = line.split("] ", 1)[-1].split()
            held[int(words[1])] = int(words[3])
    return held


def main():
    dtrain_run, trainer, example = sys.argv[1:4]
    with tempfile.TemporaryDirectory() as d:
        def train(n, sharding, optimizer, steps=6):
            out = os.path.join(d, f"w{n}-{sharding}.bin")
            text = run([dtrain_run, "-np", str(n), "--timeout", "300", "--", trainer, "--strategy=multi_worker_mirrored",
                        "--steps", str(steps), "--batch-size", "64", "--out", out, "--optimizer", optimizer],
                       env=dict(os.environ, DTRAIN_SHARDING=sharding))
            return read_weights(out), slot_elements(text)

        for optimizer in ("sgd learning_rate=0.05 momentum=0.9", "adam learning_rate=0.002",
                          "adamw learning_rate=0.002 weight_decay=0.1"):
            (ref_bytes, _), ref_held = train(2, "none", optimizer)
            for sharding in ("optimizer_state", "gradients"):
                (got, _), held = train(2, sharding, optimizer)
                if got != ref_bytes:
                    sys.exit(f"2 workers, {optimizer}, sharding {sharding}: weights differ from the unsharded job")
                whole = ref_held[0]
                if sorted(held) != [0, 1] or max(held.values()) > whole // 2 + 64 or sum(held.values()) != whole:
                    sys.exit(f"2 workers, sharding {sharding}: slot elements {held}, unsharded {whole} each")
                print(f"ok: 2 workers, {optimizer}, sharding {sharding}: bitwise the unsharded job; slot elements "
                      f"per worker {held} of {whole}")

        # bfloat16 on the wire between the workers (DTRAIN_COMPRESSION): the reduce-scatter casts as
        # the all-reduce does, so 2 workers stay bitwise.
        os.environ["DTRAIN_COMPRESSION"] = "bf16"
        (ref_bytes, _), _ = train(2, "none", "adam learning_rate=0.002")
        (got, _), _ = train(2, "gradients", "adam learning_rate=0.002")
        del os.environ["DTRAIN_COMPRESSION"]
        if got != ref_bytes:
            sys.exit("2 workers, bf16 compression: sharded weights differ from the unsharded job")
        print("ok: 2 workers, bf16 compression, sharding gradients: bitwise the unsharded job")

        clip = "adamw learning_rate=0.002 weight_decay=0.1 global_clipnorm=0.5"
        (_, ref), ref_held = train(4, "none", clip)
        for sharding in ("optimizer_state", "gradients"):
            (_, got), held = train(4, sharding, clip)
            worst = max(max(abs(p - q) for p, q in zip(x, y)) / max(1e-12, max(abs(v) for v in y))
                        for x, y in zip(got, ref))
            print(f"4 workers, {clip}, sharding {sharding}: max relative difference {worst:.3g}; "
                  f"slot elements per worker {held} of {ref_held[0]}")
            if worst > 1e-5:
                sys.exit("4 workers: sharded weights too far from the unsharded job")
            if max(held.values()) > ref_held[0] // 4 + 64 or sum(held.values()) != ref_held[0]:
                sys.exit(f"4 workers: slot elements {held}, unsharded {ref_held[0]}")

        # --- kill -9 under sharding, BackupAndRestore ---
        rng = random.Random(int(os.environ.get("DTRAIN_TEST_SEED", "7")))
        common = ["--train-limit=2880", "--batch-size=96", "--epochs=2", "--seed=5", "--backup-every=5",
                  "--sharding=gradients", "--json"]
        job = [dtrain_run, "-np", "3", "--grace", "2", "--", example, "--strategy=multi_worker_mirrored"] + common
        ref_out = run(job + ["--checkpoint-dir", f"{d}/ref"], timeout=500)
        cmd = job + ["--backup-dir", f"{d}/bk", "--checkpoint-dir", f"{d}/k"]
        code, out = start_and_kill(cmd, f"{d}/bk", lambda p: rng.choice(children(p.pid)), 10, 60)
        if code == 0:
            sys.exit(f"the sharded job survived a killed worker without --max-restarts:\n{out}")
        out = run(cmd, timeout=500)
        if "resuming from a backup" not in out:
            sys.exit(f"the second sharded run did not resume:\n{out}")
        same(f"{d}/ref/final.safetensors", f"{d}/k/final.safetensors", "sharded MWMS x3, a worker killed, run again")

        # The sharded job's checkpoint under one device: the job's own accuracy.
        want = json.loads([l.split("] ", 1)[-1] for l in ref_out.splitlines() if '"test_accuracy"' in l][-1])
        got = json.loads([l for l in run([example, "--strategy=one_device", "--restore", f"{d}/ref/final.safetensors",
                                          "--eval-only", "--train-limit=2880", "--seed=5", "--json"]).splitlines()
                          if '"test_accuracy"' in l][-1])
        if got["test_accuracy"] != want["test_accuracy"]:
            sys.exit(f"restored under one_device: {got}, the sharded job reported {want}")
        print(f"ok: the sharded job's checkpoint under one_device: accuracy {got['test_accuracy']}")
        with open(f"{d}/ref/final.safetensors", "rb") as f:
            data = f.read()
        with open(f"{d}/cut.safetensors", "wb") as f:
            f.write(data[: len(data) - 100])
        r = subprocess.run([dtrain_run, "-np", "2", "--timeout", "120", "--", example, "--strategy=multi_worker_mirrored",
                            "--sharding=gradients", "--restore", f"{d}/cut.safetensors", "--eval-only",
                            "--train-limit=2880"], capture_output=True, text=True, timeout=200)
        if r.returncode == 0 or "DataLoss" not in r.stdout + r.stderr:
            sys.exit(f"a truncated checkpoint was not refused with DataLoss:\n{r.stdout}{r.stderr}")
        print("ok: a truncated checkpoint is refused with DataLoss")


if __name__ == "__main__":
    main()
