#!/usr/bin/env python3
"""Horovod's synthetic ResNet benchmark without Horovod, for TensorFlow 2.x and PyTorch 2.x on the CPU:
the peers `dtrain-bench compare --model resnet50` sets beside examples/synthetic_benchmark.

  python bench/resnet/peer_synthetic.py tf|torch [--model resnet50] [--batch-size 32] [--threads 1]
      [--num-warmup-batches 1] [--num-batches-per-iter 1] [--num-iters 2] [--precision fp32|bf16]
      [--workers N] [--json]

As Horovod's tensorflow2_synthetic_benchmark.py and pytorch_synthetic_benchmark.py: the model built
without pretrained weights (Keras applications.ResNet50(weights=None), torchvision resnet50()), one fixed
batch of random 224x224 images and random labels of 1,000 classes, SGD at 0.01, cross-entropy; each
iteration times --num-batches-per-iter steps. TensorFlow runs a tf.function step with a GradientTape
(channels-last, as Keras stores it); PyTorch runs eager (channels-first, its default).
--precision bf16: Keras' mixed_bfloat16 policy; torch.autocast("cpu", bfloat16).
--workers N: N worker processes started by this script, one core each where there are enough
(taskset), --batch-size images each: TensorFlow under MultiWorkerMirroredStrategy (RING collectives,
each worker with its TF_CONFIG; strategy.run of the same step, as bench/tf_fashion_mnist.py), PyTorch
under DistributedDataParallel over gloo.
The last line is one JSON object: images_per_sec (mean over the iterations; with --workers, of the
whole job: the workers' rates summed) and peak_rss_mb (the largest process).
"""
import argparse, json, os, resource, sys, time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from tf_fashion_mnist import free_ports, run_workers  # noqa: E402 (bench/: imports no framework at load)


def main():
    a = argparse.ArgumentParser()
    a.add_argument("framework", choices=["tf", "torch"])
    a.add_argument("--model", default="resnet50", choices=["resnet50", "resnet101", "resnet152"])
    a.add_argument("--batch-size", type=int, default=32)
    a.add_argument("--image-size", type=int, default=224)
    a.add_argument("--threads", type=int, default=1)
    a.add_argument("--num-warmup-batches", type=int, default=1)
    a.add_argument("--num-batches-per-iter", type=int, default=1)
    a.add_argument("--num-iters", type=int, default=2)
    a.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    a.add_argument("--workers", type=int, default=1)
    a.add_argument("--worker-index", type=int, default=-1, help=argparse.SUPPRESS)
    a.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    a.add_argument("--master-addr", default="127.0.0.1",
                   help="with --worker-index and --port: rank 0's address (bench/links/links.py starts each "
                   "worker on its own netns host)")
    a.add_argument("--json", action="store_true")
    args = a.parse_args()
    if args.workers > 1 and args.worker_index < 0:
        return launch_workers(args)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    step = tf_step(args) if args.framework == "tf" else torch_step(args)
    for _ in range(args.num_warmup_batches):
        step()
    rates = []
    for it in range(args.num_iters):
        t0 = time.perf_counter()
        for _ in range(args.num_batches_per_iter):
            step()
        rate = args.batch_size * args.num_batches_per_iter / (time.perf_counter() - t0)
        print(f"Iter #{it}: {rate:.2f} img/sec", file=sys.stderr, flush=True)
        rates.append(rate)
    out = {"framework": args.framework, "model": args.model, "batch_size": args.batch_size,
           "threads": args.threads, "precision": args.precision,
           "images_per_sec": sum(rates) / len(rates),
           "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0}
    print(json.dumps(out) if args.json else out, flush=True)


def launch_workers(args):
    """Starts --workers copies of this script, one core each where there are enough; prints the job's rate."""
    ports = free_ports(args.workers)

    def env_for(i):
        env = {"TF_CPP_MIN_LOG_LEVEL": "2"}
        if args.framework == "tf":
            env["TF_CONFIG"] = json.dumps({"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
                                           "task": {"type": "worker", "index": i}})
        return env
    results = run_workers(__file__, sys.argv[1:] + [f"--port={ports[0]}"], args.workers, args.threads, env_for)
    out = dict(results[0])
    out["workers"] = args.workers
    out["images_per_sec"] = sum(r["images_per_sec"] for r in results)
    out["peak_rss_mb"] = max(r["peak_rss_mb"] for r in results)
    print(json.dumps(out) if args.json else out, flush=True)


def tf_step(args):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    if args.precision == "bf16":
        tf.keras.mixed_precision.set_global_policy("mixed_bfloat16")
    tf.random.set_seed(0)
    build = {"resnet50": tf.keras.applications.ResNet50, "resnet101": tf.keras.applications.ResNet101,
             "resnet152": tf.keras.applications.ResNet152}[args.model]
    if args.workers > 1:  # before any op runs: collectives are configured at startup
        strategy = tf.distribute.MultiWorkerMirroredStrategy(
            communication_options=tf.distribute.experimental.CommunicationOptions(
                implementation=tf.distribute.experimental.CommunicationImplementation.RING))
    else:
        strategy = tf.distribute.get_strategy()
    data = tf.random.uniform([args.batch_size, args.image_size, args.image_size, 3])
    target = tf.random.uniform([args.batch_size, 1], minval=0, maxval=999, dtype=tf.int64)
    global_batch = args.batch_size * args.workers
    with strategy.scope():
        model = build(weights=None, input_shape=(args.image_size, args.image_size, 3))
        opt = tf.keras.optimizers.SGD(0.01)
        loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(reduction="none")

    def replica_step():
        with tf.GradientTape() as tape:
            probs = model(data, training=True)
            loss = tf.nn.compute_average_loss(loss_fn(target, probs), global_batch_size=global_batch)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function
    def step():
        return strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(replica_step), axis=None)

    return lambda: step().numpy()


def torch_step(args):
    import torch
    import torch.nn.functional as F
    import torchvision
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = getattr(torchvision.models, args.model)()
    if args.workers > 1:
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method=f"tcp://{args.master_addr}:{args.port}",
                                rank=args.worker_index, world_size=args.workers)
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
    target = torch.randint(0, 1000, (args.batch_size,))
    bf16 = args.precision == "bf16"

    def step():
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = F.cross_entropy(model(data), target)
        loss.backward()
        opt.step()
        return loss.item()

    return step


if __name__ == "__main__":
    main()
