#!/usr/bin/env python3
"""One checkpoint across strategies and replica counts, with real processes.

Saved under mirrored cpu:2, restored (--restore --eval-only, which also scores
predict()'s output by hand) under one_device, mirrored cpu:3,
3 MultiWorkerMirrored workers (dtrain-run -np 3) and parameter_server (2 workers, 1 ps): the same
test accuracy (exact: it is a count) and loss (float tolerance). Then trained on under
parameter_server with Adagrad, saved there, and restored back under mirrored and one_device: again equal to
what parameter_server reports for it, from its final.safetensors and from its chief's last ckpt-N. A truncated checkpoint is refused with DataLoss.

  checkpoint_strategies_test.py DTRAIN_RUN FASHION_MNIST
"""
import json, os, shutil, subprocess, sys, tempfile

def last_json(out, strategy):
    lines = [l.split("] ", 1)[-1] for l in out.splitlines() if '"test_accuracy"' in l]
    if not lines:
        sys.exit(f"{strategy}: no JSON result:\n{out}")
    return json.loads(lines[-1])

def run(cmd, what):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    if r.returncode != 0:
        sys.exit(f"{what} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    return r.stdout + r.stderr

def main():
    dtrain_run, binary = sys.argv[1], sys.argv[2]
    common = ["--train-limit=3000", "--seed=3", "--json"]
    def under(strategy, extra):
        if strategy == "multi_worker_mirrored":
            return [dtrain_run, "-np", "3", "--", binary, "--strategy=" + strategy] + extra
        if strategy == "parameter_server":
            return [dtrain_run, "-np", "2", "--ps", "1", "--", binary, "--strategy=" + strategy] + extra
        name, _, devices = strategy.partition(" ")
        return [binary, "--strategy=" + name] + ([devices] if devices else []) + extra

    def check_everywhere(path, want, strategies, what):
        for s in strategies:
            got = last_json(run(under(s, ["--restore", path, "--eval-only"] + common), f"{s} restore"), s)
            if got["examples"] != 10000 or got["test_accuracy"] != want["test_accuracy"] or \
                    got["predict_accuracy"] != want["test_accuracy"] or \
                    abs(got["test_loss"] - want["test_loss"]) > 1e-6 * want["test_loss"]:
                sys.exit(f"{what}: under {s} the restored model gives {got}, expected {want}")
            print(f"ok: {what}, restored under {s}: accuracy {got['test_accuracy']} (predict() agrees), "
                  f"loss {got['test_loss']:.7f}")

    with tempfile.TemporaryDirectory() as d:
        saved = last_json(run(under("mirrored --devices=cpu:2", ["--epochs=1", "--checkpoint-dir", f"{d}/a"] + common),
                              "mirrored training"), "mirrored")
        a = f"{d}/a/final.safetensors"
        check_everywhere(a, saved, ["one_device", "mirrored --devices=cpu:3", "central_storage --devices=cpu:2",
                                    "multi_worker_mirrored", "parameter_server"],
                         "saved under mirrored cpu:2")
        # Trained on with Adagrad, whose slots start at 0.1 on the servers (the optimizer's config travels).
        run(under("parameter_server", ["--restore", a, "--epochs=1", "--no-eval", "--optimizer", "adagrad learning_rate=0.01",
                                       "--checkpoint-dir", f"{d}/b"] + common),
            "parameter_server training from the checkpoint")
        b = f"{d}/b/final.safetensors"
        ps_view = last_json(run(under("parameter_server", ["--restore", b, "--eval-only"] + common), "ps eval"), "ps")
        if ps_view["test_accuracy"] == saved["test_accuracy"] and ps_view["test_loss"] == saved["test_loss"]:
            sys.exit("training under parameter_server changed nothing: was the checkpoint restored into the servers?")
        check_everywhere(b, ps_view, ["mirrored --devices=cpu:2", "one_device"], "saved under parameter_server")
        # The parameter-server chief's own numbered checkpoint (its slots as "<variable>/slot_<j>":
        # refused as "a variable the model does not have" before) restores the same weights.
        with open(f"{d}/b/checkpoint") as f:
            latest = json.load(f)["latest"]
        check_everywhere(f"{d}/b/{latest}", ps_view, ["one_device"], "the ps chief's " + latest)

        # A truncated file is refused, naming what is wrong.
        shutil.copy(a, f"{d}/cut.safetensors")
        with open(f"{d}/cut.safetensors", "r+b") as f:
            f.truncate(os.path.getsize(a) - 100)
        r = subprocess.run(under("one_device", ["--restore", f"{d}/cut.safetensors", "--eval-only"]),
                           capture_output=True, text=True, timeout=120)
        if r.returncode == 0 or "DataLoss" not in r.stderr or "truncated" not in r.stderr:
            sys.exit(f"a truncated checkpoint was not refused as DataLoss ({r.returncode}):\n{r.stderr}")
        print("ok: a truncated checkpoint is refused:", r.stderr.strip().splitlines()[-1])

if __name__ == "__main__":
    main()
