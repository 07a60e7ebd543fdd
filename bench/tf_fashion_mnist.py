#!/usr/bin/env python3
"""TensorFlow peer benchmark for dtrain's Fashion-MNIST reference CNN (tensorflow-cpu 2.21).

Run with the peers' interpreter (bench/peers/setup.sh makes build/peers-venv):

    build/peers-venv/bin/python bench/tf_fashion_mnist.py --strategy one_device --threads 1 --json
    build/peers-venv/bin/python bench/tf_fashion_mnist.py --strategy mirrored --replicas 2 --json
    build/peers-venv/bin/python bench/tf_fashion_mnist.py --strategy multi_worker_mirrored --replicas 2 --json

Model (dtrain's reference model, Keras layers): Conv2D(32, 3, valid) + ReLU, MaxPool 2x2,
Conv2D(64, 3, valid) + ReLU, MaxPool 2x2, Flatten, Dense(128) + ReLU, Dense(10); sparse softmax
cross-entropy; Adam(1e-3) (Keras defaults, eps 1e-7).

Strategies, as a TensorFlow user would write them:
  one_device             a custom training loop: tf.function step with GradientTape, tf.data input
  mirrored               MirroredStrategy over --replicas logical CPU devices, Keras fit (TF 2.21's
                         custom loop fails on logical CPUs)
  multi_worker_mirrored  --replicas worker processes started by this script, each with its TF_CONFIG
                         and one core (taskset), MultiWorkerMirroredStrategy(RING), a custom loop
                         (strategy.run of a tf.function step; Keras fit fails here in TF 2.21)
--batch-size is per replica. --precision bf16 sets Keras' mixed_bfloat16 policy (bfloat16 compute,
float32 variables). Timed: the steps after --warmup, input included. The JSON line has
images_per_sec (the whole job) and peak_rss_mb (the largest process).
"""
import argparse, gzip, json, os, resource, socket, struct, subprocess, sys, time

DEFAULT_DATA_DIR = "/usr/share/datasets/fashion-mnist"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--strategy", choices=["one_device", "mirrored", "multi_worker_mirrored"], default="one_device")
    p.add_argument("--replicas", type=int, default=1, help="logical CPUs (mirrored) or worker processes (multi_worker_mirrored)")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per replica")
    p.add_argument("--batch-size", type=int, default=64, help="per replica")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--epochs", type=int, default=0, help=">0: train full epochs and report test accuracy (one_device)")
    p.add_argument("--data-dir", default=os.environ.get("DTRAIN_DATA_DIR", DEFAULT_DATA_DIR))
    p.add_argument("--json", action="store_true")
    p.add_argument("--worker-index", type=int, default=-1, help=argparse.SUPPRESS)  # set for spawned workers
    a = p.parse_args(argv)
    if a.replicas < 1 or a.threads < 1 or a.batch_size < 1 or a.steps < 1 or a.warmup < 0:
        p.error("--replicas, --threads, --batch-size and --steps must be >= 1, --warmup >= 0")
    if a.strategy == "one_device" and a.replicas != 1:
        p.error("--strategy one_device runs one replica")
    return a


def read_idx(path):
    with gzip.open(path, "rb") as f:
        data = f.read()
    _, code, ndim = struct.unpack(">HBB", data[:4])
    if code != 0x08:
        raise ValueError(f"{path}: not an unsigned-byte IDX file")
    dims = struct.unpack(">" + "I" * ndim, data[4:4 + 4 * ndim])
    import numpy as np
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def load(data_dir, split):
    import numpy as np
    prefix = "train" if split == "train" else "t10k"
    try:
        x = read_idx(os.path.join(data_dir, f"{prefix}-images-idx3-ubyte.gz"))
        y = read_idx(os.path.join(data_dir, f"{prefix}-labels-idx1-ubyte.gz"))
    except FileNotFoundError as e:
        sys.exit(f"error: Fashion-MNIST not found ({e.filename}); apt-get install dataset-fashion-mnist or set --data-dir")
    return (x.astype(np.float32) / 255.0).reshape(-1, 28, 28, 1), y.astype(np.int32)


def peak_rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def configure(tf, a):
    tf.config.threading.set_intra_op_parallelism_threads(a.threads)
    # Collective ops need a few inter-op threads; a single-replica step needs one.
    tf.config.threading.set_inter_op_parallelism_threads(1 if a.strategy == "one_device" else 2)
    if a.precision == "bf16":
        tf.keras.mixed_precision.set_global_policy("mixed_bfloat16")


def build_model(tf):
    L = tf.keras.layers
    return tf.keras.Sequential([
        tf.keras.Input((28, 28, 1)),
        L.Conv2D(32, 3, activation="relu"), L.MaxPooling2D(2),
        L.Conv2D(64, 3, activation="relu"), L.MaxPooling2D(2),
        L.Flatten(), L.Dense(128, activation="relu"),
        L.Dense(10, dtype="float32"),  # logits in float32 under mixed precision, as Keras advises
    ])


def dataset(tf, x, y, batch, seed=0):
    return (tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=seed, reshuffle_each_iteration=True)
            .repeat().batch(batch, drop_remainder=True).prefetch(2))


class Timer:
    """Keras callback: wall time from the end of batch `warmup` to the end of the last batch."""
    def __init__(self, tf, warmup):
        class CB(tf.keras.callbacks.Callback):
            def on_train_batch_end(cb, batch, logs=None):
                if batch + 1 == warmup:
                    self.t0 = time.perf_counter()
                self.t1 = time.perf_counter()
        self.t0 = self.t1 = None
        self.callback = CB()


def run_one_device(tf, a, x, y):
    model = build_model(tf)
    opt = tf.keras.optimizers.Adam(1e-3)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    it = iter(dataset(tf, x, y, a.batch_size))
    if a.epochs > 0:
        steps = a.epochs * (len(x) // a.batch_size)
        for _ in range(steps):
            loss = step(*next(it))
        xt, yt = load(a.data_dir, "test")
        pred = model.predict(xt, batch_size=1000, verbose=0).argmax(axis=1)
        return {"test_accuracy": float((pred == yt).mean()), "final_loss": float(loss), "images_per_sec": 0.0}
    t0 = None
    for s in range(a.warmup + a.steps):
        if s == a.warmup:
            t0 = time.perf_counter()
        loss = step(*next(it))
    float(loss)  # the last step has finished
    return {"images_per_sec": a.steps * a.batch_size / (time.perf_counter() - t0), "final_loss": float(loss)}


def fit_timed(tf, strategy, a, x, y, global_batch):
    with strategy.scope():
        model = build_model(tf)
        model.compile(optimizer=tf.keras.optimizers.Adam(1e-3),
                      loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    timer = Timer(tf, max(a.warmup, 1))
    h = model.fit(dataset(tf, x, y, global_batch), epochs=1, steps_per_epoch=a.warmup + a.steps,
                  callbacks=[timer.callback], verbose=0)
    steps = a.warmup + a.steps - max(a.warmup, 1)
    return {"images_per_sec": steps * global_batch / (timer.t1 - timer.t0), "final_loss": float(h.history["loss"][-1])}


def run_mirrored(tf, a, x, y):
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * a.replicas)
    strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(a.replicas)])
    return fit_timed(tf, strategy, a, x, y, a.batch_size * a.replicas)


def run_worker(tf, a, x, y):
    # A custom training loop (Keras 3's fit hands PerReplica values to its own step under MWMS in
    # TF 2.21): strategy.run of a GradientTape step over a distributed tf.data dataset.
    strategy = tf.distribute.MultiWorkerMirroredStrategy(
        communication_options=tf.distribute.experimental.CommunicationOptions(
            implementation=tf.distribute.experimental.CommunicationImplementation.RING))
    global_batch = a.batch_size * a.replicas
    with strategy.scope():
        model = build_model(tf)
        opt = tf.keras.optimizers.Adam(1e-3)
        loss_obj = tf.keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction=tf.keras.losses.Reduction.NONE)
    ds = dataset(tf, x, y, global_batch)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    it = iter(strategy.experimental_distribute_dataset(ds.with_options(options)))

    def replica_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(loss_obj(yb, model(xb, training=True)), global_batch_size=global_batch)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function
    def step(batch):
        return strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(replica_step, args=batch), axis=None)

    t0 = None
    for s in range(a.warmup + a.steps):
        if s == a.warmup:
            t0 = time.perf_counter()
        loss = step(next(it))
    float(loss)
    return {"images_per_sec": a.steps * global_batch / (time.perf_counter() - t0), "final_loss": float(loss)}


def free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def run_workers(script, argv, n, threads, env_for=lambda i: {}, timeout=3600):
    """Runs n copies of `script` with argv + --worker-index=i --json, one core share each when there are
    enough (taskset), env_for(i) added to their environment; returns the last JSON line of each, in
    order, or exits with the failed workers' stderr. The peers' launcher (this file, bench/resnet/
    peer_synthetic.py, bench/gpt/peer_gpt.py)."""
    cores = sorted(os.sched_getaffinity(0))
    procs = []
    for i in range(n):
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), **env_for(i))
        cmd = [sys.executable, os.path.abspath(script)] + [x for x in argv if x != "--json"] + \
            [f"--worker-index={i}", "--json"]
        if len(cores) >= n * threads:
            cmd = ["taskset", "-c", ",".join(map(str, cores[i * threads:(i + 1) * threads]))] + cmd
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results, failed = [], []
    for i, p in enumerate(procs):
        out, err = p.communicate(timeout=timeout)
        lines = [l for l in out.splitlines() if l.startswith("{")]
        if p.returncode != 0 or not lines:
            tail = [l for l in err.splitlines() if l.strip() and not l.lstrip().startswith(("[", "...", "0.", "]"))]
            failed.append(f"worker {i} exited {p.returncode}:\n" + "\n".join(tail[-25:]))
        else:
            results.append(json.loads(lines[-1]))
    if failed:
        sys.exit("\n".join(failed))
    return results


def launch_workers(a, argv):
    """Starts --replicas workers with their TF_CONFIG, one core each when there are enough."""
    workers = [f"127.0.0.1:{p}" for p in free_ports(a.replicas)]
    results = run_workers(__file__, argv, a.replicas, a.threads, lambda i: {
        "TF_CONFIG": json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": i}}),
        "TF_CPP_MIN_LOG_LEVEL": "2"}, timeout=1800)
    chief = results[0]
    chief["peak_rss_mb"] = max(r["peak_rss_mb"] for r in results)
    return chief


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    a = parse_args(argv)
    if a.strategy == "multi_worker_mirrored" and a.worker_index < 0:
        r = launch_workers(a, [x for x in argv if x != "--json"])
    else:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        import tensorflow as tf
        configure(tf, a)
        x, y = load(a.data_dir, "train")
        run = {"one_device": run_one_device, "mirrored": run_mirrored, "multi_worker_mirrored": run_worker}[a.strategy]
        r = run(tf, a, x, y)
        r.update({"peer": f"tensorflow {tf.__version__}", "peak_rss_mb": peak_rss_mb()})
    r.update({"strategy": a.strategy, "replicas": a.replicas, "threads": a.threads, "batch_per_replica": a.batch_size,
              "precision": a.precision, "steps": a.steps})
    if a.json:
        print(json.dumps(r), flush=True)
    else:
        print(f"{r['peer']} {a.strategy} x{a.replicas}: {r['images_per_sec']:.0f} images/sec, peak RSS {r['peak_rss_mb']:.0f} MB")


if __name__ == "__main__":
    main()
