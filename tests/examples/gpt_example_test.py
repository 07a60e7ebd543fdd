#!/usr/bin/env python3
"""examples/gpt end to end on the Perl documentation (perl-doc), with real processes:
 - one device: the loss falls below ln 256, bits per byte = nats / ln 2, --generate samples from the prompt;
 - mirrored cpu:2 and dtrain-run -np 2 (MultiWorkerMirrored) end where one device ends at the same global
   batch (losses within 1e-4, relative); parameter_server (2 workers, 1 ps) trains it too;
 - a checkpoint saved under mirrored restores under one_device (tied head included): the same sample;
 - kill -9 of the mirrored process mid-run, the same command again: final weights, AdamW slots and
   iteration count bitwise equal to an uninterrupted run.
  gpt_example_test.py DTRAIN_RUN GPT
"""
import json, math, os, signal, subprocess, sys, tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "train"))
from backup_restore_test import same, start_and_kill  # noqa: E402

SMALL = ["--preset=gpt-nano", "--context=32", "--batch-size=8", "--epochs=2", "--steps-per-epoch=6",
         "--val-windows=16", "--warmup-steps=2", "--lr=3e-3", "--seed=3", "--threads=1", "--json"]


def run(cmd, timeout=240):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        sys.exit(f"failed ({r.returncode}): {' '.join(cmd)}\n{r.stdout}\n{r.stderr}")
    return r.stdout + r.stderr


def last_json(out):
    for line in reversed(out.splitlines()):
        line = line.split("] ", 1)[-1] if line.startswith("[") else line
        if line.startswith("{"):
            return json.loads(line)
    sys.exit(f"no JSON line in:\n{out}")


def close(a, b, what, rel=1e-4):
    if abs(a - b) > rel * abs(b):
        sys.exit(f"{what}: {a} vs one device's {b}")


def main():
    launcher, gpt = sys.argv[1], sys.argv[2]
    with tempfile.TemporaryDirectory() as d:
        tok = ["--token-file", f"{d}/corpus.u8"]
        one = last_json(run([gpt] + SMALL + tok + ["--generate", "sub ", "--max-new-tokens", "40"]))
        if not one["val_loss_nats"] < math.log(256) or one["steps"] != 12:
            sys.exit(f"one device did not learn: {one}")
        close(one["val_bits_per_byte"], one["val_loss_nats"] / math.log(2), "bits per byte", 1e-9)
        if not one["sample"].startswith("sub ") or len(one["sample"].encode("latin-1", "replace")) < 44:
            sys.exit(f"bad sample: {one['sample']!r}")
        print(f"ok: one device: val loss {one['val_loss_nats']:.4f} nats, {one['val_bits_per_byte']:.3f} bits/byte")

        mir = last_json(run([gpt, "--strategy=mirrored", "--devices=cpu:2"] + SMALL + tok +
                            ["--checkpoint-dir", f"{d}/m", "--generate", "sub ", "--max-new-tokens", "40"]))
        mw = last_json(run([launcher, "-np", "2", "--timeout", "200", "--", gpt,
                            "--strategy=multi_worker_mirrored"] + SMALL + ["--token-file", f"{d}/corpus-mw.u8"]))
        for name, r in (("mirrored cpu:2", mir), ("2 workers", mw)):
            close(r["final_loss"], one["final_loss"], f"{name} final loss")
            close(r["val_loss_nats"], one["val_loss_nats"], f"{name} validation loss")
            print(f"ok: {name}: final loss {r['final_loss']:.6f}, one device {one['final_loss']:.6f}")
        ps = last_json(run([launcher, "-np", "2", "--ps", "1", "--timeout", "200", "--", gpt,
                            "--strategy=parameter_server"] + SMALL + ["--token-file", f"{d}/corpus-ps.u8"]))
        if not ps["final_loss"] < math.log(256):
            sys.exit(f"parameter_server did not train: {ps}")
        print(f"ok: parameter_server: final loss {ps['final_loss']:.4f}")

        again = last_json(run([gpt] + SMALL + tok + ["--restore", f"{d}/m/final.safetensors", "--generate-only",
                                                     "--generate", "sub ", "--max-new-tokens", "40"]))
        if again["sample"] != mir["sample"]:
            sys.exit(f"restored under one_device, the sample differs:\n{again['sample']!r}\n{mir['sample']!r}")
        print("ok: saved under mirrored, restored under one_device: the same sample")

        longer = [gpt, "--strategy=mirrored", "--devices=cpu:2", "--preset=gpt-nano", "--context=32",
                  "--batch-size=8", "--epochs=2", "--steps-per-epoch=20", "--val-windows=8", "--seed=3",
                  "--threads=1", "--backup-every=4"] + tok
        run(longer + ["--checkpoint-dir", f"{d}/ref"])
        cmd = longer + ["--backup-dir", f"{d}/bk", "--checkpoint-dir", f"{d}/k"]
        code, out = start_and_kill(cmd, f"{d}/bk", lambda p: p.pid, 24, 40)
        if code != -signal.SIGKILL:
            sys.exit(f"expected the process to die of SIGKILL, got {code}:\n{out}")
        out = run(cmd)
        if "resuming from a backup" not in out:
            sys.exit(f"the rerun did not resume:\n{out}")
        same(f"{d}/ref/final.safetensors", f"{d}/k/final.safetensors", "GPT, mirrored cpu:2, killed, run again")


if __name__ == "__main__":
    main()
