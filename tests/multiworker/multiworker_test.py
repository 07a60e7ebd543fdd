#!/usr/bin/env python3
"""MultiWorkerMirroredStrategy with real processes over TCP on 127.0.0.1.

  multiworker_test.py --launcher dtrain-run --trainer train_weights --example fashion_mnist SUITE

Suites: Equivalence (2 and 3 workers vs OneDevice at the same global batch), Faults (kill -9 a
worker mid-training, a worker that never starts, a wrong job token). Every wait is bounded.
"""
import argparse, json, os, shutil, signal, struct, subprocess, sys, tempfile, time, unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "testing"))
from ports import free_ports  # noqa: E402
from procs import Watched  # noqa: E402

ARGS = None


def read_weights(path):
    with open(path, "rb") as f:
        data = f.read()
    loss = struct.unpack_from("d", data, 0)[0]
    off, tensors = 8, []
    while off < len(data):
        (n,) = struct.unpack_from("q", data, off)
        off += 8
        tensors.append(struct.unpack_from(f"{n}f", data, off))
        off += 4 * n
    return loss, tensors


def max_rel_error(a, b):
    worst = 0.0
    for x, y in zip(a, b):
        scale = max(1e-12, max(abs(v) for v in y))
        worst = max(worst, max(abs(p - q) for p, q in zip(x, y)) / scale)
    return worst


def tf_config(ports, i):
    return json.dumps({"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]}, "task": {"type": "worker", "index": i}})


class Equivalence(unittest.TestCase):
    def train(self, launcher_np, steps, out, rows=0, optimizer=None, model=None, local=None):
        cmd = [ARGS.trainer, "--steps", str(steps), "--batch-size", "64", "--out", out, "--rows", str(rows)]
        if model:
            cmd += ["--model", model, "--sync-bn"]
        if local:  # an in-process strategy on 2 logical CPUs
            cmd += ["--strategy", local, "--devices", "cpu:2"]
        if optimizer:
            cmd += ["--optimizer", optimizer]
        if launcher_np:
            cmd = [ARGS.launcher, "-np", str(launcher_np), "--timeout", "300", "--"] + cmd + ["--strategy=multi_worker_mirrored"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=320)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        return read_weights(out)

    def test_two_and_three_workers_match_one_device(self):
        with tempfile.TemporaryDirectory() as d:
            for steps, bound in ((10, 1e-5),):
                ref_loss, ref = self.train(0, steps, os.path.join(d, "one.bin"))
                for n in (2, 3):
                    loss, w = self.train(n, steps, os.path.join(d, f"mw{n}.bin"))
                    err = max_rel_error(w, ref)
                    print(f"{n} workers, {steps} steps: max relative error {err:.3g}, loss {loss:.6f} vs {ref_loss:.6f}")
                    self.assertLessEqual(err, bound, f"{n} workers")

    def test_functional_and_subclassed_models_match_one_device(self):
        # Functional ResNets (resnet8 and resnet20: the CIFAR ResNets of depth 8 and 20, skip
        # connections, 1x1 projections) and a subclassed model (residual_cnn), both with synchronized batch
        # normalization, under 2 workers against one device at the same global batch, 3 steps: every
        # variable, the batch-norm statistics included. Batch normalization's sums over 50,000
        # activations cancel (its beta gradient is a sum of terms of both signs), so float noise in
        # their order is larger than in the reference CNN: measured on a Zen 4 EPYC, the largest
        # difference is 1.7e-4 of the largest weight and the losses agree to 6e-6; with
        # per-worker (unsynchronized) statistics the same runs differ by 3.9e-3 and 6e-4.
        # The same models under Mirrored and CentralStorage on 2 logical CPUs.
        sgd = "sgd learning_rate=0.05 momentum=0.9"
        with tempfile.TemporaryDirectory() as d:
            # ResNet-20's 19 synchronized batch norms amplify that noise further while its loss is
            # still high (5.39 on the first batch): measured, 2.8e-4 of the largest weight after 1
            # step and 2.2e-3 after 3 at this rate (the same under 2 workers and Mirrored, bitwise), so
            # it is compared after 1 step.
            for model, steps in (("resnet8", 3), ("resnet20", 1), ("residual_cnn", 3)):
                ref_loss, ref = self.train(0, steps, os.path.join(d, "one.bin"), optimizer=sgd, model=model)
                for how in ("2 workers", "mirrored", "central_storage"):
                    out = os.path.join(d, "other.bin")
                    if how == "2 workers":
                        loss, w = self.train(2, steps, out, optimizer=sgd, model=model)
                    else:
                        loss, w = self.train(0, steps, out, optimizer=sgd, model=model, local=how)
                    scale = max(max(abs(v) for v in t) for t in ref)
                    err = max(max(abs(p - q) for p, q in zip(x, y)) for x, y in zip(w, ref)) / scale
                    loss_err = abs(loss - ref_loss) / ref_loss
                    print(f"{model}, {how}, {steps} steps: largest difference {err:.3g} of the largest weight, "
                          f"loss {loss:.7f} vs {ref_loss:.7f}")
                    self.assertLessEqual(err, 1e-3, f"{model} {how}")
                    self.assertLessEqual(loss_err, 5e-5, f"{model} {how}")

    def test_a_short_last_batch_matches_one_device(self):
        # 10 batches of 64, then one of 23. Each worker's input pipeline copies only its replicas'
        # rows of a batch: with 3 workers (22 + 22 + 20 rows each) the last batch gives 22, 1 and 0.
        # Plain SGD, whose update is linear in the gradient. Adam divides by the root of the squared
        # gradients' average, which turns float noise in a near-zero gradient (the images' empty
        # borders) into a visible change: 3e-5 of a tensor's largest weight after 11 steps on an
        # AVX2 CPU, where oneDNN sums a batch of 12 images and one of 23 in other orders. With SGD the
        # workers are within 1e-7 of one device; a different row in the data moves weights by 1e-3
        # or more and the loss by 5e-5.
        sgd = "sgd learning_rate=0.01"
        with tempfile.TemporaryDirectory() as d:
            ref_loss, ref = self.train(0, 11, os.path.join(d, "one.bin"), rows=663, optimizer=sgd)
            for n in (2, 3):
                loss, w = self.train(n, 11, os.path.join(d, f"mw{n}.bin"), rows=663, optimizer=sgd)
                err = max_rel_error(w, ref)
                print(f"{n} workers, short last batch: max relative error {err:.3g}, loss {loss:.8f} vs {ref_loss:.8f}")
                self.assertLessEqual(err, 1e-5, f"{n} workers")
                self.assertLessEqual(abs(loss - ref_loss), 1e-6 * abs(ref_loss), f"{n} workers: loss")

    def test_a_batch_larger_than_the_declared_global_batch_is_refused(self):
        # Each worker's pipeline cuts its rows out of the batch; a batch of 64 rows under a declared
        # global batch of 32 must be an error naming both sizes and the fix, on every worker.
        with tempfile.TemporaryDirectory() as d:
            cmd = [ARGS.launcher, "-np", "2", "--timeout", "120", "--", ARGS.trainer, "--strategy=multi_worker_mirrored",
                   "--steps", "1", "--batch-size", "64", "--declared-batch", "32", "--out", os.path.join(d, "x.bin")]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=150)
            out = r.stdout + r.stderr
            self.assertNotEqual(r.returncode, 0, out)
            self.assertIn("the dataset yielded a batch of 64 rows", out)
            self.assertIn(".batch(32)", out)
            self.assertNotIn("took a batch", out)
            # The same call at the declared size takes the batch.
            cmd[cmd.index("--declared-batch") + 1] = "64"
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=150)
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
            self.assertIn("took a batch", r.stdout)


    def test_callbacks_that_must_run_on_every_worker_are_checked(self):
        # Horovod's idiom, `if rank == 0: callbacks.append(...)`, for a callback that takes part in
        # collectives or changes what the replicas train with: fit() refuses it on every worker before
        # the first step, naming it (a ModelCheckpoint of sharded state met the other worker's
        # gradient all-reduce as a 'collective mismatch' in the first epoch's end; a scheduler on the
        # chief alone left the replicas apart without a word). A ModelCheckpoint without sharding
        # stays the chief's alone.
        with tempfile.TemporaryDirectory() as d:
            ck = os.path.join(d, "ck")

            def job(sharding, *extra):
                cmd = [ARGS.launcher, "-np", "2", "--timeout", "120", "--", ARGS.trainer,
                       "--strategy=multi_worker_mirrored", "--steps", "6", "--steps-per-epoch", "2",
                       "--batch-size", "64", "--out", os.path.join(d, "w.bin"), "--callbacks-on-chief-only", *extra]
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=150,
                                   env=dict(os.environ, DTRAIN_SHARDING=sharding))
                return r.returncode, r.stdout + r.stderr

            code, out = job("none", "--checkpoint-dir", ck)
            self.assertEqual(code, 0, out)
            self.assertEqual(sorted(f for f in os.listdir(ck) if f.endswith(".safetensors")),
                             ["ckpt-2.safetensors", "ckpt-4.safetensors", "ckpt-6.safetensors"])
            shutil.rmtree(ck)
            for sharding, flags, name in (("optimizer_state", ["--checkpoint-dir", ck], "ModelCheckpoint(" + ck + ", loss)"),
                                          ("none", ["--lr-decay", "0.5"], "LearningRateScheduler"),
                                          ("parameters", ["--patience", "1"], "EarlyStopping(loss)")):
                code, out = job(sharding, *flags)
                self.assertNotEqual(code, 0, out)
                self.assertNotIn("collective mismatch", out)
                for rank, says in ((0, f"this worker (0) runs {name}; worker 1 runs none"),
                                   (1, f"this worker (1) runs none; worker 0 runs 1")):
                    self.assertIn(f"[worker:{rank}] error: FailedPrecondition: fit(): the workers run different "
                                  "callbacks", out)
                    self.assertIn(says, out)
                self.assertNotIn("optimizer slot elements", out)  # neither trained on
                self.assertFalse(os.path.exists(ck) and os.listdir(ck), out)


class Mpi(unittest.TestCase):
    """The MPI backend: the same training under mpirun with DTRAIN_COLLECTIVE=mpi."""

    def test_two_workers_under_mpirun_match_one_device(self):
        mpirun = shutil.which("mpirun")
        if not mpirun:
            self.skipTest("mpirun not installed (apt-get install openmpi-bin libopenmpi-dev)")
        env = dict(os.environ, DTRAIN_COLLECTIVE="mpi", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        with tempfile.TemporaryDirectory() as d:
            one, mpi = os.path.join(d, "one.bin"), os.path.join(d, "mpi.bin")
            r = subprocess.run([ARGS.trainer, "--steps", "10", "--out", one], capture_output=True, text=True, timeout=300)
            self.assertEqual(r.returncode, 0, r.stderr)
            r = subprocess.run([mpirun, "--oversubscribe", "--bind-to", "none", "-np", "2", ARGS.trainer,
                                "--strategy=multi_worker_mirrored", "--steps", "10", "--out", mpi],
                               capture_output=True, text=True, timeout=300, env=env)
            if "no MPI backend" in r.stderr:
                self.skipTest("this build has no MPI backend")
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
            (l1, w1), (l2, w2) = read_weights(one), read_weights(mpi)
            err = max_rel_error(w2, w1)
            print(f"mpirun -np 2: max relative error {err:.3g}, loss {l2:.6f} vs {l1:.6f}")
            self.assertLessEqual(err, 1e-5)


class Fallback(unittest.TestCase):
    """Ranks of one host that cannot share memory (worker 1 sees its own /dev/shm, as in a second
    container in the same network namespace) fall back to the sockets, say so, and train the same."""

    def job(self, d, name, isolate):
        ports, out = free_ports(2), os.path.join(d, name + ".bin")
        procs = []
        for i in range(2):
            cmd = [ARGS.trainer, "--strategy=multi_worker_mirrored", "--steps", "6", "--out", out]
            if i == 1 and isolate:  # a private mount namespace with an empty /dev/shm of its own
                cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                       'mount -t tmpfs tmpfs /dev/shm && exec "$@"', "sh"] + cmd
            env = dict(os.environ, TF_CONFIG=tf_config(ports, i), DTRAIN_JOB_TOKEN="a-token-for-the-fallback-0123",
                       DTRAIN_LOG_LEVEL="INFO")
            procs.append(Watched(cmd, env=env))
        logs = []
        for i, p in enumerate(procs):
            _, err = p.communicate(120)
            self.assertEqual(p.returncode, 0, f"worker {i}:\n{err[-3000:]}")
            logs.append(err)
        return read_weights(out), logs

    def test_ranks_that_cannot_map_each_others_memory_use_the_sockets(self):
        if os.geteuid() != 0 or not shutil.which("unshare"):
            self.skipTest("needs root and unshare (util-linux) for a private /dev/shm")
        probe = subprocess.run(["unshare", "--mount", "true"], capture_output=True)
        if probe.returncode != 0:
            self.skipTest("mount namespaces cannot be made here")
        with tempfile.TemporaryDirectory() as d:
            (ref_loss, ref), ref_logs = self.job(d, "shm", isolate=False)
            self.assertIn("through shared memory", ref_logs[0])
            (loss, w), logs = self.job(d, "fallback", isolate=True)
            both = "".join(logs)
            self.assertIn("a peer could not map shared memory", both, both[-3000:])
            self.assertNotIn("collective data through shared memory", both)
            err = max_rel_error(w, ref)
            print(f"fallback to sockets: loss {loss:.8f} vs {ref_loss:.8f} through shared memory, max relative "
                  f"error {err:.3g}")
            self.assertEqual(err, 0.0, "the sockets' ring must sum exactly as the shared-memory one")


class Faults(unittest.TestCase):
    def start(self, ports, i, token, extra_env=None, steps=100000):
        # A 2 s heartbeat timeout (5 s by default) names a stopped worker sooner; a 3 s rendezvous
        # timeout names an absent one.
        env = dict(os.environ, TF_CONFIG=tf_config(ports, i), DTRAIN_JOB_TOKEN=token, DTRAIN_RENDEZVOUS_TIMEOUT="3",
                   DTRAIN_HEARTBEAT_TIMEOUT="2", DTRAIN_LOG_LEVEL="WARNING")  # the refusal is a WARNING line
        env.update(extra_env or {})
        p = Watched([ARGS.example, "--strategy=multi_worker_mirrored", "--devices=cpu", "--threads", "1",
                     "--steps", str(steps), "--batch-size", "96", "--no-eval"], env=env)
        self.addCleanup(self.reap, p)  # a failed assertion leaves no process behind
        return p

    @staticmethod
    def in_training(procs):
        """Returns once every worker is training: each has printed its devices, which it does after
        the rendezvous, as fit() starts; 0.5 s later all are in the middle of it."""
        for i, p in enumerate(procs):
            p.wait_for("local devices:", 60, f"worker {i}")
        time.sleep(0.5)

    @staticmethod
    def reap(p):
        if p.poll() is None:
            p.kill()
        p.communicate(10)

    def finish(self, p, timeout, what="the process"):
        """(exit code, stderr) of a process that exits within timeout s. One that does not is killed
        and fails the test: a fault must end the process, printing the right error and then hanging
        is a failure."""
        try:
            _, err = p.communicate(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate(10)
            self.fail(f"{what} did not exit within {timeout} s (hung); killed it. stderr:\n{err[-2000:]}")
        self.assertIsInstance(p.returncode, int)
        return p.returncode, err

    def test_kill_9_a_worker_mid_training(self):
        ports = free_ports(3)
        procs = [self.start(ports, i, "t0ken-for-the-kill-test-0123") for i in range(3)]
        self.in_training(procs)
        self.assertIsNone(procs[1].poll(), "worker 1 ended before it could be killed")
        procs[1].send_signal(signal.SIGKILL)
        t0 = time.time()
        for i in (0, 2):
            code, err = self.finish(procs[i], 30, f"worker {i}, 30 s after worker 1 was killed,")
            self.assertNotEqual(code, 0, err[-2000:])
            self.assertIn("worker:1", err, err[-2000:])
        print(f"survivors exited {time.time() - t0:.2f} s after the kill")
        self.finish(procs[1], 5)

    def test_a_hung_worker_is_named_by_heartbeat_timeout(self):
        ports = free_ports(3)
        procs = [self.start(ports, i, "t0ken-for-the-hang-test-0123") for i in range(3)]
        self.in_training(procs)
        self.assertIsNone(procs[1].poll(), "worker 1 ended before it could be stopped")
        procs[1].send_signal(signal.SIGSTOP)  # alive but silent: no data, no heartbeats
        t0 = time.time()
        try:
            for i in (0, 2):
                code, err = self.finish(procs[i], 30, f"worker {i}, 30 s after worker 1 hung,")
                self.assertNotEqual(code, 0, err[-2000:])
                self.assertIn("worker:1", err, err[-2000:])
            print(f"survivors exited {time.time() - t0:.2f} s after worker 1 was stopped")
        finally:
            procs[1].send_signal(signal.SIGKILL)
            self.finish(procs[1], 5)

    def test_a_worker_that_never_starts_is_named(self):
        ports = free_ports(3)
        procs = [self.start(ports, i, "t0ken-for-the-absent-test-01") for i in range(2)]
        for i, p in enumerate(procs):
            code, err = self.finish(p, 30, f"worker {i}, waiting for an absent worker:2,")
            self.assertNotEqual(code, 0, err[-2000:])
            self.assertIn("worker:2", err, err[-2000:])
            self.assertIn("never heard from", err)

    def test_a_wrong_job_token_is_refused(self):
        ports = free_ports(2)
        good = self.start(ports, 0, "the-right-job-token-0123456")
        bad = self.start(ports, 1, "a-wrong-job-token-987654321")
        code, err = self.finish(bad, 30, "the worker with the wrong token")
        self.assertNotEqual(code, 0, err[-2000:])
        self.assertIn("job token", err, err[-2000:])
        code, err = self.finish(good, 30, "the worker that refused the wrong token")
        self.assertNotEqual(code, 0, err[-2000:])
        self.assertIn("refused a connection", err + "", err[-2000:])


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--launcher", required=True)
    p.add_argument("--trainer", required=True)
    p.add_argument("--example", required=True)
    ARGS, rest = p.parse_known_args()
    result = unittest.main(argv=[sys.argv[0]] + rest, verbosity=2, exit=False).result
    if not result.wasSuccessful():
        sys.exit(1)
    # Every test skipped (no mpirun, or dtrain built without MPI): CTest's Skipped, not Passed.
    sys.exit(77 if result.skipped and len(result.skipped) == result.testsRun else 0)
