#!/usr/bin/env python3
"""examples/fashion_mnist and examples/resnet reading their images from files (--image-dir: PNG class
folders through image_dataset_from_directory, decoded on the input pipeline's reader threads):
  - the folders the example writes (--write-image-dir) hold Fashion-MNIST exactly: a checkpoint
    evaluated on them gives the IDX files' test accuracy and loss;
  - training from the files under Mirrored cpu:2 and under `dtrain-run -np 2` ends at bitwise the
    same weights (each worker decodes only its rows of every global batch);
  - a worker killed with kill -9 mid-epoch, the job run again with --backup-dir: it resumes at
    its step, mid-epoch, and ends at the uninterrupted run's weights, bit for bit;
  - the ResNet example trains from the folders (images resized to 32x32 on decode).

  image_dir_test.py DTRAIN_RUN FASHION_MNIST RESNET
"""
import json, os, random, sys, tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "train"))
from backup_restore_test import children, run, same, start_and_kill  # noqa: E402


def last_json(out):
    return json.loads([l for l in out.splitlines() if l.startswith("{")][-1])


def main():
    dtrain_run, fashion, resnet = sys.argv[1:4]
    rng = random.Random(3)
    with tempfile.TemporaryDirectory(prefix="dtrain_image_dir_") as d:
        images = f"{d}/images"
        code, out = run([fashion, "--write-image-dir", images, "--train-limit", "1920"])
        assert code == 0, out
        assert len(os.listdir(f"{images}/train")) == 10, os.listdir(f"{images}/train")

        # The files hold Fashion-MNIST exactly: evaluate one checkpoint on both.
        common = ["--batch-size=96", "--seed=5", "--train-limit=1920"]
        code, out = run([fashion, "--epochs=1", "--no-eval", "--checkpoint-dir", f"{d}/c"] + common)
        assert code == 0, out
        ev = [fashion, "--eval-only", "--restore", f"{d}/c/final.safetensors", "--json"]
        code, out = run(ev)
        assert code == 0, out
        idx = last_json(out)
        code, out = run(ev + ["--image-dir", images])
        assert code == 0, out
        files = last_json(out)
        assert files["examples"] == idx["examples"] == 10000, (files, idx)
        assert files["test_accuracy"] == idx["test_accuracy"], (files, idx)
        assert abs(files["test_loss"] - idx["test_loss"]) < 1e-5, (files, idx)
        print(f"ok: a checkpoint scores {idx['test_accuracy']:.4f} on the IDX files and on the PNG folders")

        # Training from the files: Mirrored cpu:2 and two workers agree bitwise.
        train = ["--image-dir", images, "--epochs=2", "--no-eval", "--backup-every=4"] + common
        code, out = run([fashion, "--strategy=mirrored", "--devices=cpu:2", "--checkpoint-dir", f"{d}/m"] + train)
        assert code == 0, out
        mwms = [dtrain_run, "-np", "2", "--grace", "2", "--", fashion, "--strategy=multi_worker_mirrored"] + train
        code, out = run(mwms + ["--checkpoint-dir", f"{d}/w"])
        assert code == 0, out
        same(f"{d}/m/final.safetensors", f"{d}/w/final.safetensors",
             "training from PNG folders: Mirrored cpu:2 vs dtrain-run -np 2")

        # kill -9 a worker mid-epoch; the rerun resumes from the backup and ends bitwise equal.
        cmd = mwms + ["--backup-dir", f"{d}/bk", "--checkpoint-dir", f"{d}/k"]
        total = 2 * 1920 // 96
        code, out = start_and_kill(cmd, f"{d}/bk", lambda p: rng.choice(children(p.pid)), 12, total)
        assert code != 0, f"the job survived a killed worker:\n{out}"
        code, out = run(cmd)
        assert code == 0 and "resuming from a backup" in out, out
        same(f"{d}/w/final.safetensors", f"{d}/k/final.safetensors",
             "training from PNG folders, 2 workers, a worker killed mid-epoch, run again")

        # The ResNet example from the same folders (32x32 on decode), a few steps.
        code, out = run([resnet, "--model=resnet8", "--image-dir", images, "--steps=6", "--batch-size=64",
                         "--no-eval", "--json", "--train-limit=1920"])
        assert code == 0, out
        r = last_json(out)
        assert r["steps"] == 6 and r["final_loss"] > 0, r
        print(f"ok: resnet8 from the PNG folders: 6 steps, loss {r['final_loss']:.3f}")


if __name__ == "__main__":
    main()
