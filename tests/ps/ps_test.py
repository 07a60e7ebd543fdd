#!/usr/bin/env python3
"""ParameterServerStrategy with real ps and worker processes over TCP on 127.0.0.1.

  ps_test.py --launcher dtrain-run --check ps_check --example fashion_mnist SUITE

Suites:
  Basics    concurrent pushes lose no update; partitioners place shards; wrong token; garbage frames
  Faults    kill -9 a worker (the job finishes); kill -9 a ps (every worker names it); relaunch
            after a kill resumes from the checkpoint with the step count intact
  Equivalence  1 worker with 1 ps, and with 2 ps holding shards, equals one_device to 1e-7
Every wait is bounded; every process is killed on the way out.
"""
import argparse, json, math, os, signal, socket, struct, subprocess, sys, tempfile, time, unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "testing"))
from ports import free_ports  # noqa: E402
from procs import Watched  # noqa: E402

ARGS = None


def last_json(text):
    for line in reversed(text.splitlines()):
        line = line.split("] ", 1)[-1] if line.startswith("[") else line
        if line.startswith("{"):
            return json.loads(line)
    raise AssertionError("no JSON line in output:\n" + text[-3000:])


class Job:
    """The tasks of one job started by hand, each with its TF_CONFIG, as a user does in shells."""

    def __init__(self, workers, ps, token="a-job-token-for-the-ps-tests-0123"):
        ports = free_ports(workers + ps)
        self.cluster = {"worker": [f"127.0.0.1:{p}" for p in ports[:workers]],
                        "ps": [f"127.0.0.1:{p}" for p in ports[workers:]]}
        self.token = token
        self.procs = {}  # (kind, index) -> Watched
        self.killed = set()  # processes this test killed on purpose (their exit status is not checked)

    def env(self, kind, i, token=None, extra=None):
        env = dict(os.environ, TF_CONFIG=json.dumps({"cluster": self.cluster, "task": {"type": kind, "index": i}}),
                   DTRAIN_JOB_TOKEN=token or self.token, DTRAIN_LOG_LEVEL="INFO")
        env.update(extra or {})
        return env

    def start(self, kind, i, argv, token=None, extra=None):
        p = Watched(argv, env=self.env(kind, i, token, extra))
        self.procs[(kind, i)] = p
        return p

    def wait_for(self, kind, i, text, timeout):
        """Waits until task kind:i has printed `text`; fails if it exits first or takes > timeout s."""
        self.procs[(kind, i)].wait_for(text, timeout, f"{kind}:{i}")

    def start_ps(self, argv):
        for i in range(len(self.cluster["ps"])):
            self.start("ps", i, argv)

    def kill(self, kind, i):
        """kill -9 a task on purpose."""
        p = self.procs[(kind, i)]
        self.killed.add(p)
        p.send_signal(signal.SIGKILL)

    def finish(self, kind, i, timeout):
        """(exit code, stdout, stderr) of a task that exits within timeout s. One that does not is
        killed and fails the test: printing the right error and then hanging is a failure."""
        p = self.procs[(kind, i)]
        try:
            out, err = p.communicate(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate(10)
            raise AssertionError(f"{kind}:{i} did not exit within {timeout} s (hung); killed it. "
                                 f"stderr:\n{err[-2000:]}")
        assert isinstance(p.returncode, int), p.returncode
        return p.returncode, out, err

    def stop(self):
        """SIGTERM to every task still running, then the parameter servers' exit status checked: a ps
        task serves until SIGTERM and exits 0 (README), so one that exits otherwise, ends early on its
        own, or hangs on SIGTERM fails the test. Tasks the test killed on purpose are not checked."""
        ended_early = set()
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
            else:
                ended_early.add(p)
        hung = set()
        for p in self.procs.values():
            try:
                p.communicate(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.communicate(10)
                hung.add(p)
        problems = []
        for (kind, i), p in self.procs.items():
            if kind != "ps" or p in self.killed:
                continue
            _, err = p.communicate(10)
            if p in hung:
                problems.append(f"ps:{i} did not exit within 10 s of SIGTERM (hung)")
            elif p in ended_early:
                problems.append(f"ps:{i} ended with {p.returncode} before it was stopped; stderr:\n{err[-2000:]}")
            elif p.returncode != 0:
                problems.append(f"ps:{i} exited with {p.returncode}, not 0 (a ps task exits 0 on SIGTERM); "
                                f"stderr:\n{err[-2000:]}")
        if problems:
            raise AssertionError("\n".join(problems))


def example(*extra):
    return [ARGS.example, "--strategy=parameter_server", "--devices=cpu", "--threads", "1", "--batch-size", "64",
            "--no-eval", "--json"] + list(extra)


class Basics(unittest.TestCase):
    def run_launcher(self, np, ps, argv, timeout=120, extra=()):
        r = subprocess.run([ARGS.launcher, "-np", str(np), "--ps", str(ps), "--timeout", str(timeout)] + list(extra) +
                           ["--"] + argv,
                           capture_output=True, text=True, timeout=timeout + 20)
        self.assertEqual(r.returncode, 0, r.stdout[-3000:] + r.stderr[-3000:])
        return r

    def test_concurrent_pushes_lose_no_update(self):
        for ps in (1, 2):
            r = self.run_launcher(3, ps, [ARGS.check, "counter", "1000"])
            j = last_json(r.stdout)
            print(f"3 workers x 1000 pushes of -1, {ps} ps: value {j['value']}, global step {j['global_step']}")
            self.assertEqual(j["value"], 3000.0)
            self.assertEqual(j["global_step"], 3000)

    def test_partitioners_place_shards_and_read_back_whole(self):
        j = last_json(self.run_launcher(1, 2, [ARGS.check, "shards"]).stdout)
        def layout(name):
            return [(s["task"], s["shape"]) for s in j[name]["shards"]]
        self.assertEqual(layout("fixed3"), [("ps:0", "[4, 4]"), ("ps:1", "[3, 4]"), ("ps:0", "[3, 4]")])
        self.assertEqual(layout("min_size"), [("ps:0", "[5, 4]"), ("ps:1", "[5, 4]")])
        self.assertEqual(layout("max_size"), [("ps:0", "[3, 4]"), ("ps:1", "[3, 4]"), ("ps:0", "[2, 4]"),
                                              ("ps:1", "[2, 4]")])
        self.assertEqual(layout("scalar"), [("ps:0", "[]")])
        for name, case in j.items():
            self.assertTrue(case["whole"], name)
            self.assertTrue(all(s["match"] for s in case["shards"]), name)

    def test_a_wrong_job_token_is_refused(self):
        job = Job(1, 1)
        try:
            job.start_ps([ARGS.check])
            job.start("worker", 0, [ARGS.check, "counter", "10"], token="not-the-job-token-987654321")
            code, _, err = job.finish("worker", 0, 60)
            self.assertNotEqual(code, 0, err[-2000:])
            self.assertIn("job token", err, err[-2000:])
            self.assertIsNone(job.procs[("ps", 0)].poll(), "the ps died on an unauthenticated connection")
        finally:
            job.stop()
        _, _, ps_err = job.finish("ps", 0, 10)
        self.assertIn("refused", ps_err, ps_err[-2000:])

    def test_garbage_and_unauthenticated_frames_do_not_hurt_the_server(self):
        job = Job(1, 1)
        try:
            job.start_ps([ARGS.check])
            host, port = job.cluster["ps"][0].split(":")
            time.sleep(0.5)
            payloads = [b"GET / HTTP/1.0\r\n\r\n", b"\x00" * 48, os.urandom(4096),
                        # a well-formed header claiming a 1 TB payload, then silence
                        struct.pack("<IHHQHBBIQQQ", 0x4e525444, 1, 6, 1, 4, 0, 0, 0, 0, 1 << 40, 0)]
            for data in payloads:
                for _ in range(50):
                    try:
                        s = socket.create_connection((host, int(port)), timeout=5)
                        break
                    except OSError:
                        time.sleep(0.1)
                s.sendall(data)
                s.close()
            job.start("worker", 0, [ARGS.check, "counter", "50"])
            code, out, err = job.finish("worker", 0, 60)
            self.assertEqual(code, 0, err[-2000:])
            self.assertEqual(last_json(out)["value"], 50.0)
        finally:
            job.stop()


    def test_two_stop_signals_at_once_still_end_the_ps_with_0(self):
        # Ctrl-C and a launcher's SIGTERM arrive together: the server takes the first, and the second,
        # still pending when serve_parameter_server() gives the caller its signal mask back, must not
        # kill the process after its clean stop (it ended with -15 or -2 before).
        for first, second in ((signal.SIGINT, signal.SIGTERM), (signal.SIGTERM, signal.SIGINT)):
            job = Job(1, 1)
            job.start_ps([ARGS.check])
            job.wait_for("ps", 0, "serving on", 30)
            p = job.procs[("ps", 0)]
            p.send_signal(first)
            p.send_signal(second)
            code, _, err = job.finish("ps", 0, 10)
            self.assertEqual(code, 0, f"{first.name} then {second.name}: {err[-2000:]}")

    def test_staleness_bound_holds_the_fast_worker_back(self):
        times = {}
        for k in (-1, 2):
            r = self.run_launcher(2, 1, [ARGS.check, "stale", str(k), "60", "20"])
            t = {}
            for line in r.stdout.splitlines():
                if "{" in line and '"seconds"' in line:
                    j = json.loads(line[line.index("{"):])
                    t[j["worker"]] = j["seconds"]
            times[k] = t
            print(f"max_staleness {k}: fast worker {t[0]:.2f} s, slow worker (20 ms/step) {t[1]:.2f} s")
        self.assertLess(times[-1][0], 0.5 * times[-1][1], "without a bound the fast worker should not wait")
        self.assertGreater(times[2][0], 0.8 * times[2][1], "with max_staleness 2 the fast worker ran ahead")
        # The slow worker starting 1.5 s late: the bound holds the fast one from the start.
        job = Job(2, 1)
        try:
            job.start_ps([ARGS.check])
            job.start("worker", 0, [ARGS.check, "stale", "2", "60", "20"])
            time.sleep(1.5)
            job.start("worker", 1, [ARGS.check, "stale", "2", "60", "20"])
            t = {}
            for i in (0, 1):
                code, out, err = job.finish("worker", i, 60)
                self.assertEqual(code, 0, err[-2000:])
                t[i] = last_json(out)["seconds"]
            print(f"late slow worker: fast {t[0]:.2f} s, slow {t[1]:.2f} s")
            self.assertGreater(t[0], t[1], "the fast worker ran ahead before the slow one arrived")
        finally:
            job.stop()

    def test_the_evaluator_follows_the_checkpoints_to_the_final_one(self):
        with tempfile.TemporaryDirectory() as d:
            r = self.run_launcher(2, 1, [ARGS.example, "--strategy=parameter_server", "--threads", "1", "--no-eval",
                                         "--steps", "300", "--checkpoint-dir", d, "--checkpoint-every", "100", "--json"],
                                  extra=["--evaluator"])
            evals = [json.loads(l[l.index("{"):]) for l in r.stdout.splitlines()
                     if l.startswith("[evaluator:0] {")]
            print("evaluator saw steps", [e["evaluator_step"] for e in evals], "final accuracy",
                  evals[-1]["test_accuracy"] if evals else None)
            self.assertTrue(evals, r.stdout[-3000:] + r.stderr[-3000:])
            self.assertTrue(evals[-1]["final"])
            self.assertGreaterEqual(evals[-1]["evaluator_step"], 300)
            self.assertGreater(evals[-1]["test_accuracy"], 0.6)

    def test_a_checkpoint_of_another_optimizer_restores_weights_not_slots(self):
        # SGD's momentum and RMSprop's velocity are one slot each: restored into RMSprop, the
        # momentum buffer was taken for the velocity and the loss went NaN at once. Now the slots
        # start afresh (said once), as the synchronous strategies do; the same optimizer's slots are
        # still restored.
        with tempfile.TemporaryDirectory() as d:
            def run(steps, optimizer):
                r = self.run_launcher(1, 1, [ARGS.example, "--strategy=parameter_server", "--threads", "1",
                                             "--no-eval", "--steps", str(steps), "--checkpoint-dir", d,
                                             "--checkpoint-every", "30", "--optimizer", optimizer, "--json"])
                loss = json.loads(r.stdout[r.stdout.index("{"):].splitlines()[0])["final_loss"]
                return loss, r.stderr
            def latest():
                with open(os.path.join(d, "checkpoint")) as f:
                    path = os.path.join(d, json.load(f)["latest"])
                with open(path, "rb") as f:
                    n = struct.unpack("<Q", f.read(8))[0]
                    header = json.loads(f.read(n))
                    return path, header, f.read()
            run(60, "sgd momentum=0.9")
            loss, err = run(120, "rmsprop")
            self.assertTrue(loss is not None and math.isfinite(loss), f"final loss {loss}\n{err[-2000:]}")
            self.assertEqual(err.count("they start afresh"), 1, err[-2000:])
            self.assertIn("(momentum) are not rmsprop's (velocity)", err)
            # The step count started again with the slots (Adam's bias correction reads it).
            _, header, _ = latest()
            self.assertEqual(header["__metadata__"]["conv1/kernel/updates"], "60")
            self.assertEqual(header["__metadata__"]["conv1/kernel/slot_names"], "velocity")
            # A checkpoint written before the slots were named: its slots are kept when their
            # number fits (they were all dropped as "unnamed" at first).
            path, header, data = latest()
            header["__metadata__"] = {k: v for k, v in header["__metadata__"].items()
                                      if not k.endswith("/slot_names")}
            text = json.dumps(header).encode()
            text += b" " * (-len(text) % 8)
            with open(path, "wb") as f:
                f.write(struct.pack("<Q", len(text)) + text + data)
            loss, err = run(180, "rmsprop")
            self.assertTrue(loss is not None and math.isfinite(loss), f"final loss {loss}")
            self.assertNotIn("afresh", err)
            self.assertEqual(latest()[1]["__metadata__"]["conv1/kernel/updates"], "120")

    def test_the_evaluator_takes_sigterm_without_a_handler(self):
        # A SIGTERM handler runs on whichever thread the signal interrupts, and oneDNN 2.x's float32
        # GEMM runs with its stack pointer on a heap workspace: the handler's signal frame corrupted
        # the heap (an evaluator aborted in about 1 job in 40). The evaluator takes SIGTERM with
        # sigwait (dtrain::StopSignals): no handler (SigCgt), every thread but the waiting one blocks
        # it (SigBlk), and SIGTERM still ends it, with status 0.
        job = Job(workers=1, ps=1)
        with tempfile.TemporaryDirectory() as d:
            p = job.start("evaluator", 0, example("--checkpoint-dir", d))
            term = 1 << (signal.SIGTERM - 1)

            def status(path):
                with open(path) as f:
                    return dict(l.split(":", 1) for l in f if ":" in l)
            threads = {}
            deadline = time.time() + 60
            while time.time() < deadline and p.poll() is None:  # until the CPU device's thread runs
                try:
                    threads = {t: status(f"/proc/{p.p.pid}/task/{t}/status") for t in os.listdir(f"/proc/{p.p.pid}/task")}
                except (FileNotFoundError, ProcessLookupError):
                    pass
                if any(s["Name"].strip() == "CPU:0 device" for s in threads.values()):
                    break
                time.sleep(0.1)
            names = sorted(s["Name"].strip() for s in threads.values())
            self.assertIn("CPU:0 device", names, names)
            self.assertIn("stop signals", names, names)
            self.assertEqual(int(status(f"/proc/{p.p.pid}/status")["SigCgt"], 16) & term, 0, "a SIGTERM handler")
            for t, s in threads.items():
                if s["Name"].strip() != "stop signals":
                    self.assertTrue(int(s["SigBlk"], 16) & term, f"thread {t} ({s['Name'].strip()}) takes SIGTERM")
            p.send_signal(signal.SIGTERM)
            code, out, err = job.finish("evaluator", 0, 60)
            self.assertEqual(code, 0, err[-2000:])


class Faults(unittest.TestCase):
    def test_kill_9_a_worker_the_job_finishes_and_a_restarted_one_rejoins(self):
        job = Job(3, 1)
        try:
            job.start_ps(example())
            # Batches of 16: about 10 s of training for the 3 workers on 2 cores, while the restart
            # below takes about 1 s; the restarted worker must find the job still running.
            steps = "3000"
            argv = example("--steps", steps)
            argv[argv.index("--batch-size") + 1] = "16"
            for i in range(3):
                job.start("worker", i, argv)
            job.wait_for("worker", 2, "local devices:", 60)  # printed as fit() starts
            job.kill("worker", 2)
            job.finish("worker", 2, 5)
            job.start("worker", 2, argv)  # the same task again
            job.wait_for("worker", 2, "local devices:", 60)
            self.assertIsNone(job.procs[("worker", 0)].poll(), "the chief stopped when worker 2 died")
            results = {i: job.finish("worker", i, 180) for i in range(3)}
            for i, (code, out, err) in results.items():
                self.assertEqual(code, 0, f"worker {i}: " + err[-3000:])
            restarted = last_json(results[2][1])
            chief = last_json(results[0][1])
            print(f"after the kill: chief ran {chief['steps']} steps, the restarted worker {restarted['steps']}, "
                  f"job step {chief['job_step']}")
            self.assertGreater(restarted["steps"], 0, "the restarted worker did not train")
            self.assertGreaterEqual(chief["job_step"], int(steps))
        finally:
            job.stop()

    def test_kill_9_a_ps_every_worker_names_it(self):
        job = Job(2, 2)
        try:
            job.start_ps(example())
            for i in range(2):
                job.start("worker", i, example("--steps", "100000"))
            for i in range(2):
                job.wait_for("worker", i, "local devices:", 60)
            self.assertIsNone(job.procs[("ps", 1)].poll(), "ps 1 ended before it could be killed")
            job.kill("ps", 1)
            t0 = time.time()
            for i in range(2):
                code, _, err = job.finish("worker", i, 30)  # fails the test if it is still running after 30 s
                self.assertNotEqual(code, 0, err[-2000:])
                self.assertIn("ps:1", err, err[-2000:])
                self.assertIn("Unavailable", err, err[-2000:])
            print(f"workers exited {time.time() - t0:.2f} s after ps:1 was killed")
        finally:
            job.stop()

    def test_relaunch_after_a_kill_resumes_from_the_checkpoint(self):
        with tempfile.TemporaryDirectory() as d:
            ckpt = os.path.join(d, "ckpt")
            job = Job(2, 2)
            args = ["--steps", "100000", "--checkpoint-dir", ckpt, "--checkpoint-every", "50"]
            try:
                job.start_ps(example())
                for i in range(2):
                    job.start("worker", i, example(*args))
                deadline = time.time() + 60
                while time.time() < deadline and not os.path.exists(os.path.join(ckpt, "checkpoint")):
                    time.sleep(0.05)
                time.sleep(0.3)  # past the checkpoint, mid-training
                job.kill("ps", 0)
                for i in range(2):
                    code, _, err = job.finish("worker", i, 30)
                    self.assertNotEqual(code, 0, err[-2000:])
            finally:
                job.stop()
            with open(os.path.join(ckpt, "checkpoint")) as f:
                saved = json.load(f)["step"]
            self.assertGreaterEqual(saved, 50)
            # The whole job again, new processes, same checkpoint directory, 60 more global steps, and
            # the variables now split in 3 shards (checkpoints hold whole variables).
            target = saved + 60
            job = Job(2, 2)
            try:
                job.start_ps(example())
                for i in range(2):
                    job.start("worker", i, example("--steps", str(target), "--checkpoint-dir", ckpt,
                                                   "--checkpoint-every", "50", "--ps-shards", "3"))
                code, out, err = job.finish("worker", 0, 120)
                self.assertEqual(code, 0, err[-3000:])
                self.assertIn(f"restoring from checkpoint", err)
                self.assertIn(f"(global step {saved})", err)
                j = last_json(out)
                print(f"killed after checkpoint step {saved}; relaunch ran {j['steps']} local steps to job step "
                      f"{j['job_step']}")
                self.assertGreaterEqual(j["job_step"], target)
                self.assertLess(j["steps"], 60 + 2, "the relaunch started over instead of resuming")
            finally:
                job.stop()
            with open(os.path.join(ckpt, "checkpoint")) as f:
                self.assertGreaterEqual(json.load(f)["step"], target)


class Equivalence(unittest.TestCase):
    def test_one_worker_equals_one_device(self):
        # One worker has nobody to race: the servers apply its pushes in order, so the job must equal
        # one_device bitwise (measured: the same final loss to the last bit), whole or sharded over
        # 2 ps. 47 steps with a short last batch, then the test set.
        data = ["--threads", "1", "--epochs", "1", "--train-limit", "3000", "--batch-size", "64", "--json"]
        r = subprocess.run([ARGS.example, "--strategy=one_device"] + data, capture_output=True, text=True, timeout=120)
        self.assertEqual(r.returncode, 0, r.stderr[-3000:])
        ref = last_json(r.stdout)
        for ps in (1, 2):
            r = subprocess.run([ARGS.launcher, "-np", "1", "--ps", str(ps), "--timeout", "120", "--", ARGS.example,
                                "--strategy=parameter_server", "--ps-shards", str(ps)] + data,
                               capture_output=True, text=True, timeout=150)
            self.assertEqual(r.returncode, 0, r.stdout[-3000:] + r.stderr[-3000:])
            j = last_json(r.stdout)
            print(f"1 worker + {ps} ps: final loss {j['final_loss']!r} (one_device {ref['final_loss']!r}), "
                  f"test accuracy {j['test_accuracy']} ({ref['test_accuracy']}), job step {j['job_step']}")
            self.assertEqual(j["job_step"], ref["steps"])
            for key in ("final_loss", "test_loss", "test_accuracy"):
                self.assertAlmostEqual(j[key], ref[key], delta=1e-7 * abs(ref[key]), msg=f"{ps} ps: {key}")

    def test_functional_and_subclassed_models_equal_one_device(self):
        # The same with a functional ResNet (resnet8, batch normalization, 1x1 projections) and a
        # subclassed model (residual_cnn), their variables sharded over 2 ps: 10 steps.
        data = ["--threads", "1", "--epochs", "1", "--train-limit", "640", "--batch-size", "64", "--json"]
        for model in ("resnet8", "residual_cnn"):
            r = subprocess.run([ARGS.example, "--strategy=one_device", "--model", model] + data,
                               capture_output=True, text=True, timeout=120)
            self.assertEqual(r.returncode, 0, r.stderr[-3000:])
            ref = last_json(r.stdout)
            r = subprocess.run([ARGS.launcher, "-np", "1", "--ps", "2", "--timeout", "120", "--", ARGS.example,
                                "--strategy=parameter_server", "--ps-shards", "2", "--model", model] + data,
                               capture_output=True, text=True, timeout=150)
            self.assertEqual(r.returncode, 0, r.stdout[-3000:] + r.stderr[-3000:])
            j = last_json(r.stdout)
            print(f"{model}, 1 worker + 2 ps: final loss {j['final_loss']!r} (one_device {ref['final_loss']!r}), "
                  f"test loss {j['test_loss']!r} ({ref['test_loss']!r})")
            self.assertEqual(j["job_step"], ref["steps"])
            for key in ("final_loss", "test_loss", "test_accuracy"):
                self.assertAlmostEqual(j[key], ref[key], delta=1e-7 * abs(ref[key]), msg=f"{model}: {key}")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--launcher", required=True)
    p.add_argument("--check", required=True)
    p.add_argument("--example", required=True)
    ARGS, rest = p.parse_known_args()
    unittest.main(argv=[sys.argv[0]] + rest, verbosity=2)
