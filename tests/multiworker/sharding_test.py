#!/usr/bin/env python3
"""Sharded optimizer state, gradients and parameters (--sharding / DTRAIN_SHARDING, ZeRO-1, 2 and 3)
under MultiWorkerMirrored with real processes over TCP on 127.0.0.1.

  sharding_test.py DTRAIN_RUN TRAIN_WEIGHTS FASHION_MNIST GPT

- 2 workers: every weight bitwise equal to the unsharded job (a sum of two addends does not depend on
  the collective's order), SGD with momentum, Adam and AdamW, both stages; each worker holds half the
  optimizer state.
- 4 workers, AdamW with global-norm clipping: within float rounding of the unsharded job (the ring's
  reduce-scatter adds four addends in another order); each worker holds a quarter of the state.
- kill -9 of a worker of a sharded 3-worker job, the command run again: BackupAndRestore resumes and
  the final checkpoint is bitwise that of an uninterrupted sharded run; that checkpoint (slots
  written whole) restores under one_device with the job's own test accuracy, and a truncated copy
  of it is refused with DataLoss.
- ZeRO-3 (examples/gpt --sharding=parameters: each transformer block's weights kept as parts and
  gathered per block, with and without --recompute): 2 workers bitwise the ZeRO-2 job (the example
  clips by global norm, which sharded jobs sum from parts), 3 workers (uneven parts) within float
  rounding of the unsharded job; kill -9 of a worker, run again: BackupAndRestore resumes
  bitwise the uninterrupted ZeRO-3 run; its checkpoint restores under one_device.
"""
import json, os, random, struct, subprocess, sys, tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "train"))
from backup_restore_test import children, same, start_and_kill, tensors  # noqa: E402
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


def kill_and_resume(cmd, backup_dir, rng, min_step, total_steps, timeout):
    """kill -9 of a random worker of `cmd` once a backup at >= min_step exists, then `cmd` again, which must
    resume from the backup."""
    code, out = start_and_kill(cmd, backup_dir, lambda p: rng.choice(children(p.pid)), min_step, total_steps)
    if code == 0:
        sys.exit(f"the sharded job survived a killed worker without --max-restarts:\n{out}")
    out = run(cmd, timeout=timeout)
    if "resuming from a backup" not in out:
        sys.exit(f"the second sharded run did not resume:\n{out}")


def slot_elements(out):
    """Per worker: the optimizer slot elements it reported holding."""
    held = {}
    for line in out.splitlines():
        if "optimizer slot elements" in line:
            words = line.split("] ", 1)[-1].split()
            held[int(words[1])] = int(words[3])
    return held


def main():
    dtrain_run, trainer, example, gpt = sys.argv[1:5]
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
        kill_and_resume(cmd, f"{d}/bk", rng, 10, 60, 500)
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

        zero3(dtrain_run, gpt, d, rng)


def zero3(dtrain_run, gpt, d, rng):
    """ZeRO-3 on the GPT example: equivalence, and kill -9 + BackupAndRestore."""
    common = ["--preset", "gpt-nano", "--context", "32", "--batch-size", "12", "--epochs", "3",
              "--steps-per-epoch", "8", "--warmup-steps", "4", "--seed", "3"]

    def job(n, sharding, tag, extra=(), val=12):
        out = f"{d}/gpt-{tag}"
        text = run([dtrain_run, "-np", str(n), "--grace", "2", "--", gpt, "--strategy=multi_worker_mirrored",
                    f"--sharding={sharding}", "--checkpoint-dir", out, "--val-windows", str(val)] + common
                   + list(extra), timeout=300)
        return f"{out}/final.safetensors", text

    # The example clips by global norm, which sharded jobs sum from parts (in float64): the ZeRO-2
    # job is the bitwise reference, the unsharded one is within rounding (3 workers below).
    ref, _ = job(2, "gradients", "ref2")
    for extra in (["--recompute"], []):
        got, _ = job(2, "parameters", "z3-" + str(len(extra)), extra)
        same(ref, got, f"GPT, 2 workers, ZeRO-3{' with recompute' if extra else ''} vs ZeRO-2")
    # One validation window for 2 workers: one has no rows, yet every forward pass gathers each
    # block from both (it runs the model on a row of zeros); the validation loss is the one row's.
    _, one = job(2, "parameters", "z3-val1", ["--json"], val=1)
    _, one_ref = job(2, "gradients", "z2-val1", ["--json"], val=1)
    vals = [json.loads(t.split("] ", 1)[-1].strip().splitlines()[-1])["val_loss_nats"]
            for t in (one, one_ref) for t in [[l for l in t.splitlines() if '"val_loss_nats"' in l][-1]]]
    if vals[0] != vals[1]:
        sys.exit(f"one validation window: ZeRO-3 {vals[0]}, ZeRO-2 {vals[1]}")
    print(f"ok: GPT, 2 workers, one validation window (a worker with no rows): ZeRO-3 = ZeRO-2 ({vals[0]})")
    # EarlyStopping(restore_best_weights) on every worker under ZeRO-3: at the best epoch's end it
    # gathers each block's parts whole from both processes, and when it stops each replica takes its
    # part of them back. With min_delta 100 nats no epoch beats the first: it stops after the second,
    # and the final weights are the first epoch's (its ModelCheckpoint file, ckpt-8), bitwise the
    # ZeRO-2 job's.
    es = ["--patience", "1", "--min-delta", "100"]
    z3es, text = job(2, "parameters", "z3-es", es)
    z2es, _ = job(2, "gradients", "z2-es", es)
    same(z2es, z3es, "GPT, 2 workers, EarlyStopping restoring the best weights: ZeRO-3 vs ZeRO-2")
    final, first = tensors(z3es), tensors(f"{d}/gpt-z3-es/ckpt-8.safetensors")
    model = [k for k in final if not k.startswith(("optimizer/", "rng/"))]
    if len(model) < 10 or any(final[k] != first[k] for k in model):
        sys.exit(f"ZeRO-3 EarlyStopping: the final weights are not the first epoch's ({len(model)} compared):\n{text}")
    if os.path.exists(f"{d}/gpt-z3-es/ckpt-24.safetensors"):
        sys.exit("ZeRO-3 EarlyStopping: the job did not stop after the second epoch")
    print(f"ok: ZeRO-3 EarlyStopping: its {len(model)} model tensors are the first epoch's")
    ref3, _ = job(3, "none", "ref3")
    z2, _ = job(3, "gradients", "z2x3", ["--recompute"])
    got3, text = job(3, "parameters", "z3x3", ["--recompute", "--json"])
    if "parameters (ZeRO-3)" not in text:
        sys.exit(f"the 3-worker job did not report ZeRO-3:\n{text}")
    same(z2, got3, "GPT, 3 workers (uneven parts), ZeRO-3 with recompute vs ZeRO-2")

    def floats(path):
        return {k: struct.unpack(f"<{len(raw) // 4}f", raw) for k, (dt, _, raw) in tensors(path).items() if dt == "F32"}
    a, b = floats(ref3), floats(got3)
    if a.keys() != b.keys():
        sys.exit(f"3 workers: different tensors {sorted(a.keys() ^ b.keys())}")
    # Attention's key bias has a zero gradient in exact arithmetic (softmax does not see a shift
    # shared by all keys): AdamW turns rounding noise into lr-sized steps, so it is left out.
    worst = max(max(abs(p - q) for p, q in zip(a[k], b[k])) / max(1e-12, max(abs(v) for v in a[k]))
                for k in a if "attn/key/bias" not in k)
    print(f"GPT, 3 workers, ZeRO-3 with recompute: max relative difference {worst:.3g} from the unsharded job")
    if worst > 1e-4:
        sys.exit("3 workers: ZeRO-3 weights too far from the unsharded job")

    # kill -9 of a worker mid-run; the same command again resumes from the backup, bitwise.
    uninterrupted, _ = job(2, "parameters", "z3-ref", ["--recompute", "--backup-every", "3"])
    cmd = [dtrain_run, "-np", "2", "--grace", "2", "--", gpt, "--strategy=multi_worker_mirrored",
           "--sharding=parameters", "--recompute", "--backup-every", "3", "--backup-dir", f"{d}/gpt-bk",
           "--checkpoint-dir", f"{d}/gpt-k", "--val-windows", "12"] + common
    kill_and_resume(cmd, f"{d}/gpt-bk", rng, 6, 24, 300)
    same(uninterrupted, f"{d}/gpt-k/final.safetensors", "GPT ZeRO-3 x2, a worker killed, run again")
    text = run([gpt, "--strategy=one_device", "--restore", uninterrupted, "--generate-only", "--generate", "The ",
                "--max-new-tokens", "8"] + common)
    print("ok: the ZeRO-3 checkpoint generates under one_device:", text.strip().splitlines()[-2:])


if __name__ == "__main__":
    main()
