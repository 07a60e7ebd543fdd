#!/usr/bin/python3
"""PyTorch single-process peer benchmark for dtrain's Fashion-MNIST CNN.

Run with the interpreter that has PyTorch installed, e.g.:

    /usr/bin/python3 bench/torch_fashion_mnist.py --threads 1 --steps 300 --json

Model (identical to dtrain's reference model):
    Conv2d(1,32,3, valid) + ReLU -> MaxPool 2x2
    Conv2d(32,64,3, valid) + ReLU -> MaxPool 2x2
    Flatten -> Linear(1600,128) + ReLU -> Linear(128,10)
Loss: softmax cross-entropy (nn.CrossEntropyLoss, mean reduction).
Optimizer: Adam lr=1e-3, betas=(0.9, 0.999), eps=1e-7.
    NOTE: eps=1e-7 matches Keras' Adam default (PyTorch's default is 1e-8).

Timing: steady-state training steps (host-side batch slicing + forward +
backward + optimizer step). The first --warmup steps are excluded.

Data: gzip IDX files under /usr/share/datasets/fashion-mnist (override with
--data-dir or the DTRAIN_DATA_DIR environment variable). Read with
gzip + numpy only (no torchvision).
"""

import argparse
import gzip
import json
import os
import resource
import signal
import struct
import sys
import time

try:
    import numpy as np
    import torch
    import torch.nn as nn
except ImportError:  # pragma: no cover - depends on the interpreter
    sys.stderr.write(
        "error: PyTorch/numpy is not importable by %s; run this script with "
        "an interpreter that has torch installed (e.g. /usr/bin/python3)\n"
        % sys.executable)
    sys.exit(2)

DEFAULT_DATA_DIR = "/usr/share/datasets/fashion-mnist"
FILES = {
    "train_images": "train-images-idx3-ubyte.gz",
    "train_labels": "train-labels-idx1-ubyte.gz",
    "test_images": "t10k-images-idx3-ubyte.gz",
    "test_labels": "t10k-labels-idx1-ubyte.gz",
}


# --------------------------------------------------------------------------
# Data loading (gzip IDX -> numpy)
# --------------------------------------------------------------------------

def _read_idx(path):
    with gzip.open(path, "rb") as f:
        data = f.read()
    if len(data) < 4:
        raise ValueError("%s: truncated IDX header" % path)
    zero, dtype_code, ndim = struct.unpack(">HBB", data[:4])
    if zero != 0 or dtype_code != 0x08:
        raise ValueError("%s: not an unsigned-byte IDX file (magic %02x%02x)"
                         % (path, dtype_code, ndim))
    header_len = 4 + 4 * ndim
    dims = struct.unpack(">" + "I" * ndim, data[4:header_len])
    count = int(np.prod(dims)) if dims else 0
    if len(data) - header_len != count:
        raise ValueError("%s: expected %d payload bytes, found %d"
                         % (path, count, len(data) - header_len))
    return np.frombuffer(data, dtype=np.uint8, offset=header_len).reshape(dims)


def data_dir_from(arg):
    if arg:
        return arg
    return os.environ.get("DTRAIN_DATA_DIR", DEFAULT_DATA_DIR)


def check_data(data_dir, need_test):
    keys = ["train_images", "train_labels"]
    if need_test:
        keys += ["test_images", "test_labels"]
    missing = [os.path.join(data_dir, FILES[k]) for k in keys
               if not os.path.isfile(os.path.join(data_dir, FILES[k]))]
    if missing:
        sys.stderr.write(
            "error: Fashion-MNIST data not found; missing file(s):\n  %s\n"
            "Provide the gzip IDX files in that directory, or point "
            "--data-dir / DTRAIN_DATA_DIR at them.\n"
            % "\n  ".join(missing))
        sys.exit(2)


def load_split(data_dir, split):
    """Returns (images float32 [N,1,28,28] in [0,1], labels int64 [N])."""
    imgs = _read_idx(os.path.join(data_dir, FILES[split + "_images"]))
    labels = _read_idx(os.path.join(data_dir, FILES[split + "_labels"]))
    if imgs.ndim != 3 or imgs.shape[1:] != (28, 28):
        raise ValueError("unexpected image shape %r" % (imgs.shape,))
    if labels.shape[0] != imgs.shape[0]:
        raise ValueError("image/label count mismatch: %d vs %d"
                         % (imgs.shape[0], labels.shape[0]))
    x = (imgs.astype(np.float32) / 255.0).reshape(-1, 1, 28, 28)
    y = labels.astype(np.int64)
    return np.ascontiguousarray(x), y


# --------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------

def build_model():
    return nn.Sequential(
        nn.Conv2d(1, 32, kernel_size=3),   # valid padding
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, kernel_size=3),  # valid padding
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * 5 * 5, 128),        # 1600 -> 128
        nn.ReLU(),
        nn.Linear(128, 10),
    )


def build_optimizer(model):
    # eps=1e-7 to match Keras' Adam default (PyTorch defaults to 1e-8).
    return torch.optim.Adam(model.parameters(), lr=1e-3,
                            betas=(0.9, 0.999), eps=1e-7)


def evaluate(model, x, y, batch=1000):
    model.eval()
    correct = 0
    with torch.no_grad():
        for i in range(0, x.shape[0], batch):
            logits = model(x[i:i + batch])
            correct += int((logits.argmax(dim=1) == y[i:i + batch]).sum())
    model.train()
    return correct / float(x.shape[0])


# --------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1,
                   help="intra-op and inter-op threads (default 1)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--steps", type=int, default=300,
                   help="timed steps (after warmup) when --epochs is 0")
    p.add_argument("--warmup", type=int, default=20,
                   help="untimed warmup steps (default 20)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--epochs", type=int, default=0,
                   help="0 = run --warmup + --steps steps; >0 = train full "
                        "epochs and evaluate test accuracy")
    p.add_argument("--data-dir", default=None,
                   help="directory with the gzip IDX files (default %s)"
                        % DEFAULT_DATA_DIR)
    p.add_argument("--timeout", type=float, default=1800.0,
                   help="hard wall-clock limit in seconds (default 1800)")
    p.add_argument("--json", action="store_true",
                   help="print a final JSON line with the results")
    args = p.parse_args(argv)
    if args.threads < 1 or args.batch_size < 1 or args.steps < 0 \
            or args.warmup < 0 or args.epochs < 0:
        p.error("--threads/--batch-size must be >= 1; "
                "--steps/--warmup/--epochs must be >= 0")
    return args


def install_timeout(seconds):
    if seconds and seconds > 0 and hasattr(signal, "SIGALRM"):
        def _on_alarm(signum, frame):
            sys.stderr.write("error: benchmark exceeded --timeout of %g s\n"
                             % seconds)
            sys.stderr.flush()
            os._exit(3)
        signal.signal(signal.SIGALRM, _on_alarm)
        signal.alarm(max(1, int(seconds)))


def main(argv=None):
    args = parse_args(argv)
    install_timeout(args.timeout)

    torch.set_num_threads(args.threads)
    try:
        torch.set_num_interop_threads(args.threads)
    except RuntimeError:
        pass  # already set (only possible once per process)
    torch.manual_seed(args.seed)

    data_dir = data_dir_from(args.data_dir)
    check_data(data_dir, need_test=args.epochs > 0)
    x_np, y_np = load_split(data_dir, "train")
    x_train = torch.from_numpy(x_np)
    y_train = torch.from_numpy(y_np)
    n = x_train.shape[0]
    bs = args.batch_size
    steps_per_epoch = n // bs  # drop last
    if steps_per_epoch == 0:
        sys.stderr.write("error: batch size %d exceeds dataset size %d\n"
                         % (bs, n))
        return 2

    model = build_model()
    model.train()
    opt = build_optimizer(model)
    loss_fn = nn.CrossEntropyLoss()

    if args.epochs > 0:
        total_steps = args.epochs * steps_per_epoch
        warmup = min(args.warmup, total_steps)
    else:
        warmup = args.warmup
        total_steps = warmup + args.steps
    timed_steps = total_steps - warmup

    gen = torch.Generator()
    gen.manual_seed(args.seed)
    perm = None
    t0 = None
    if warmup == 0:
        t0 = time.perf_counter()
    for step in range(total_steps):
        pos = step % steps_per_epoch
        if pos == 0:
            perm = torch.randperm(n, generator=gen)
        idx = perm[pos * bs:(pos + 1) * bs]
        xb = x_train.index_select(0, idx)
        yb = y_train.index_select(0, idx)

        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(xb), yb)
        loss.backward()
        opt.step()

        if step + 1 == warmup:
            t0 = time.perf_counter()
    t1 = time.perf_counter()
    final_loss = float(loss.detach()) if total_steps > 0 else None

    elapsed = (t1 - t0) if t0 is not None else 0.0
    ips = (timed_steps * bs / elapsed) if elapsed > 0 and timed_steps > 0 \
        else 0.0

    test_acc = None
    if args.epochs > 0:
        xt_np, yt_np = load_split(data_dir, "test")
        test_acc = evaluate(model, torch.from_numpy(xt_np),
                            torch.from_numpy(yt_np))

    line = ("pytorch %s: threads=%d batch=%d timed_steps=%d (warmup %d) "
            "time=%.3fs images/sec=%.1f final_loss=%s"
            % (torch.__version__, args.threads, bs, timed_steps, warmup,
               elapsed, ips,
               "n/a" if final_loss is None else "%.4f" % final_loss))
    if test_acc is not None:
        line += " test_accuracy=%.4f (epochs=%d)" % (test_acc, args.epochs)
    print(line, flush=True)

    if args.json:
        print(json.dumps({
            "framework": "pytorch",
            "torch_version": torch.__version__,
            "threads": args.threads,
            "batch": bs,
            "steps": timed_steps,
            "images_per_sec": round(ips, 3),
            "final_loss": final_loss,
            "test_accuracy": test_acc,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
        }), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
