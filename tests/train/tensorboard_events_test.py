#!/usr/bin/env python3
"""dtrain's TensorBoard event files, read by TensorBoard's own reader (EventAccumulator).

Trains the example for two short epochs with --tensorboard-dir and --csv-log, then loads the event
files with tensorboard.backend.event_processing.event_accumulator (which checks every record's
masked CRC-32C) and checks the scalars against the run's JSON line and CSV log.

  tensorboard_events_test.py FASHION_MNIST_BINARY   (run with a python that has tensorboard)
"""
import csv, glob, json, os, subprocess, sys, tempfile

SKIP = 77  # ctest SKIP_RETURN_CODE

def main():
    try:
        from tensorboard.backend.event_processing import event_accumulator as ea
    except ImportError:
        print("SKIPPED: the tensorboard package is not installed (setup.sh test installs it from PyPI "
              "into build/venv)")
        sys.exit(SKIP)
    binary = sys.argv[1]
    with tempfile.TemporaryDirectory() as d:
        logdir, csv_path = os.path.join(d, "tb"), os.path.join(d, "log.csv")
        cmd = [binary, "--strategy=mirrored", "--devices=cpu:2", "--epochs=2", "--train-limit=1536",
               "--batch-size=64", "--tensorboard-dir", logdir, "--csv-log", csv_path, "--json"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            sys.exit(f"exit {r.returncode}:\n{r.stdout}\n{r.stderr}")
        result = json.loads([l for l in r.stdout.splitlines() if l.strip()][-1])
        files = glob.glob(os.path.join(logdir, "*", "events.out.tfevents.*"))
        assert len(files) == 2, files
        scalars = {}
        for sub in ("train", "validation"):
            acc = ea.EventAccumulator(os.path.join(logdir, sub))
            acc.Reload()
            scalars[sub] = {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}
        train, val = scalars["train"], scalars["validation"]
        for tag in ("epoch_loss", "epoch_accuracy", "epoch_learning_rate", "epoch_images_per_sec"):
            assert [s for s, _ in train[tag]] == [0, 1], (tag, train.get(tag))
        for tag in ("epoch_loss", "epoch_accuracy"):
            assert [s for s, _ in val[tag]] == [0, 1], (tag, val.get(tag))
        def close(a, b):
            return abs(a - b) <= 1e-6 * max(1.0, abs(b))  # float32 in the events
        assert close(train["epoch_loss"][1][1], result["final_loss"]), (train["epoch_loss"], result)
        assert close(val["epoch_accuracy"][1][1], result["test_accuracy"]), (val["epoch_accuracy"], result)
        assert close(val["epoch_loss"][1][1], result["test_loss"]), (val["epoch_loss"], result)
        assert close(train["epoch_learning_rate"][0][1], 1e-3)
        # Every 100 batches: 24 batches per epoch x 2 = 48 steps, so none; the batch tags need update_freq.
        with open(csv_path) as f:
            rows = list(csv.DictReader(f))
        assert len(rows) == 2, rows
        for i, row in enumerate(rows):
            assert close(float(row["loss"]), train["epoch_loss"][i][1]), (row, train["epoch_loss"])
            assert close(float(row["val_accuracy"]), val["epoch_accuracy"][i][1])
        print("ok: TensorBoard read", sum(len(v) for v in train.values()) + sum(len(v) for v in val.values()),
              "scalars from", len(files), "event files; they match the JSON result and the CSV log")

if __name__ == "__main__":
    main()
