#!/usr/bin/env python3
"""End-to-end tests of dtrain-run: real processes, real signals, bounded waits.

  python3 tests/launcher/launcher_test.py --launcher build/tools/dtrain-run [unittest args...]

e.g. `... LocalJob` or `... Failure.test_failed_worker_stops_the_others` to run a part. The
parameter-server jobs' suite, PsJob, is launcher_ps_test.py.
Every wait is bounded; a launcher still alive at the end of a test is killed (its children die
with it, through PR_SET_PDEATHSIG), so a broken launcher fails the tests instead of hanging them.
"""
import json
import os
import re
import signal
import socket
import subprocess
import time

import launcher_case
from launcher_case import HEX64, LauncherCase, process_state, wait_until


class LocalJob(LauncherCase):
    def test_three_workers_get_distinct_tf_configs(self):
        env = dict(os.environ, TF_CONFIG="stale", DTRAIN_TASK="stale")
        env.pop("DTRAIN_JOB_TOKEN", None)
        status, out, err, _ = self.run_launcher(["-np", "3"], self.fake(), env=env)
        self.assertEqual(status, 0, err)
        tasks = [f"worker:{i}" for i in range(3)]
        reports = {t: self.report(t) for t in tasks}
        cluster = None
        for i, t in enumerate(tasks):
            cfg = json.loads(reports[t]["tf_config"])
            self.assertEqual(cfg["task"], {"type": "worker", "index": i})
            self.assertEqual(set(cfg["cluster"]), {"worker"})
            cluster = cluster or cfg["cluster"]
            self.assertEqual(cfg["cluster"], cluster, "every task must see the same cluster")
            self.assertEqual(reports[t]["task"], t)
            self.assertTrue(reports[t]["stdin_is_devnull"])
        addrs = cluster["worker"]
        self.assertEqual(len(addrs), 3)
        ports = set()
        for a in addrs:
            host, port = a.rsplit(":", 1)
            self.assertEqual(host, "127.0.0.1")
            self.assertTrue(1 <= int(port) <= 65535)
            ports.add(int(port))
        self.assertEqual(len(ports), 3, f"ports not distinct: {addrs}")
        tokens = {r["token"] for r in reports.values()}
        self.assertEqual(len(tokens), 1, "one job token for every task")
        self.assertRegex(tokens.pop(), HEX64)

    def test_each_task_is_bound_to_its_share_of_the_cores(self):
        allowed = sorted(os.sched_getaffinity(0))
        env = dict(os.environ)
        env.pop("OMP_NUM_THREADS", None)
        for n in (1, 2, 3):
            status, _, err, _ = self.run_launcher(["-np", str(n)], self.fake(), env=env)
            self.assertEqual(status, 0, err)
            reports = [self.report(f"worker:{i}") for i in range(n)]
            if n <= len(allowed):  # an equal, disjoint share each
                per = len(allowed) // n
                for i, r in enumerate(reports):
                    self.assertEqual(r["cpus"], allowed[i * per:(i + 1) * per], f"worker:{i} of {n}")
                    self.assertEqual(r["omp_num_threads"], str(per))
                    self.assertEqual((r["local_rank"], r["local_world_size"]), (str(i), str(n)))  # torchrun's
            else:  # more tasks than cores: one core each, round robin
                for i, r in enumerate(reports):
                    self.assertEqual(r["cpus"], [allowed[i % len(allowed)]])
                    self.assertEqual(r["omp_num_threads"], "1")

    def test_bind_to_none_and_a_given_omp_num_threads_are_respected(self):
        allowed = sorted(os.sched_getaffinity(0))
        env = dict(os.environ, OMP_NUM_THREADS="7")
        status, _, err, _ = self.run_launcher(["-np", "2"], self.fake(), env=env)
        self.assertEqual(status, 0, err)
        self.assertEqual(self.report("worker:0")["omp_num_threads"], "7")  # the user's setting wins
        env.pop("OMP_NUM_THREADS")
        status, _, err, _ = self.run_launcher(["--bind-to", "none", "-np", "2"], self.fake(), env=env)
        self.assertEqual(status, 0, err)
        for i in range(2):
            r = self.report(f"worker:{i}")
            self.assertEqual(r["cpus"], allowed)
            self.assertIsNone(r["omp_num_threads"])

    def test_job_token_from_environment_is_kept(self):
        env = dict(os.environ, DTRAIN_JOB_TOKEN="my-token")
        status, _, err, _ = self.run_launcher(["-np", "2"], self.fake(), env=env)
        self.assertEqual(status, 0, err)
        self.assertEqual({self.report(f"worker:{i}")["token"] for i in range(2)}, {"my-token"})

    def test_token_differs_between_jobs(self):
        env = dict(os.environ)
        env.pop("DTRAIN_JOB_TOKEN", None)
        self.assertEqual(self.run_launcher(["-np", "1"], self.fake(), env=env)[0], 0)
        first = self.report("worker:0")["token"]
        self.assertEqual(self.run_launcher(["-np", "1"], self.fake(), env=env)[0], 0)
        self.assertNotEqual(first, self.report("worker:0")["token"])

    def test_output_is_prefixed_per_stream(self):
        status, out, err, _ = self.run_launcher(["-np", "3"], self.fake("--partial"))
        self.assertEqual(status, 0, err)
        for i in range(3):
            self.assertIn(f"[worker:{i}] hello from worker:{i}\n", out)
            self.assertIn(f"[worker:{i}] error stream of worker:{i}\n", err)
            self.assertIn(f"[worker:{i}] no newline from worker:{i}\n", out)
            self.assertNotIn(f"error stream of worker:{i}", out)
            self.assertNotIn(f"hello from worker:{i}", err)

    def test_lines_are_never_torn(self):
        status, out, err, _ = self.run_launcher(["-np", "4"], self.fake("--lines", "2000"))
        self.assertEqual(status, 0, err)
        pattern = re.compile(r"^\[(worker:\d)\] (hello from \1|line (\d+) of \1 (x*))$")
        counts = {}
        for line in out.splitlines():
            m = pattern.match(line)
            self.assertIsNotNone(m, f"torn or unprefixed line: {line[:120]!r}")
            if m.group(3) is not None:
                self.assertEqual(len(m.group(4)), int(m.group(3)) % 300, line[:120])
                counts[m.group(1)] = counts.get(m.group(1), 0) + 1
        self.assertEqual(counts, {f"worker:{i}": 2000 for i in range(4)})

    def test_ps_and_evaluator(self):
        status, out, err, _ = self.run_launcher(
            ["-np", "2", "--ps", "2", "--evaluator"],
            self.fake("--sleep", "60", "--sleep-tasks", "ps:0,ps:1",
                      "--wait-for", "ps:0,ps:1,evaluator:0"), timeout=30)
        self.assertEqual(status, 0, err)  # parameter servers are stopped once the workers are done
        self.assertIn("stopping 2 parameter server(s)", err)
        tasks = ["worker:0", "worker:1", "ps:0", "ps:1", "evaluator:0"]
        reports = {t: self.report(t) for t in tasks}
        # LOCAL_RANK numbers the training tasks on a host; ps and evaluator tasks get none.
        self.assertEqual([reports[t]["local_rank"] for t in tasks], ["0", "1", None, None, None])
        for t in tasks:
            typ, idx = t.split(":")
            cfg = json.loads(reports[t]["tf_config"])
            self.assertEqual(cfg["task"], {"type": typ, "index": int(idx)})
            self.assertEqual([len(cfg["cluster"][k]) for k in ("worker", "ps", "evaluator")],
                             [2, 2, 1])
            self.assertIn(f"[{t}] hello from {t}\n", out)
        all_addrs = sum(json.loads(reports["ps:0"]["tf_config"])["cluster"].values(), [])
        self.assertEqual(len(set(all_addrs)), 5)
        self.assert_gone([reports["ps:0"]["pid"], reports["ps:1"]["pid"]])

    def test_devices_appended_unless_given(self):
        self.assertEqual(self.run_launcher(["-np", "1", "--devices", "cpu:2"], self.fake())[0], 0)
        self.assertEqual(self.report("worker:0")["extra_args"], ["--devices=cpu:2"])
        for given in (["--devices=cpu:4"], ["--devices", "cpu:4"]):
            self.assertEqual(
                self.run_launcher(["-np", "1", "--devices", "cpu:2"], self.fake(*given))[0], 0)
            argv = self.report("worker:0")["argv"]
            self.assertNotIn("--devices=cpu:2", argv)
            self.assertEqual(argv[-len(given):], given)

    def test_the_programs_own_np_is_left_alone(self):
        # Without --, everything from the program on is the program's, -np included (dtrain-run
        # spells its own -np as --np for its parser; the program's must reach it as given).
        cmd = [launcher_case.LAUNCHER, "-np", "1", *self.fake("-np", "4", "-np=5")]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(self.report("worker:0")["extra_args"], ["-np", "4", "-np=5"])

    def test_fixed_ports_with_port_base(self):
        status, _, err, _ = self.run_launcher(["-np", "2", "--port-base", "31000"], self.fake())
        self.assertEqual(status, 0, err)
        cfg = json.loads(self.report("worker:1")["tf_config"])
        self.assertEqual(cfg["cluster"]["worker"], ["127.0.0.1:31000", "127.0.0.1:31001"])


class Failure(LauncherCase):
    def test_failed_worker_stops_the_others(self):
        p = self.start_launcher(["-np", "3"], self.fake(
            "--fail-task", "worker:1", "--fail-code", "3", "--fail-after", "0.5",
            "--sleep", "60", "--grandchild", "--wait-for", "worker:0,worker:1,worker:2"))
        reports = self.wait_reports([f"worker:{i}" for i in range(3)])
        out, err = self.finish_within(p, 6, 3)
        self.assertIn("dtrain-run: worker:1 exited with status 3\n", err)
        self.assertEqual(err.count("dtrain-run: "), 1, err)  # only the failure is named
        # The worker's own last words come before the launcher's line about it.
        self.assertLess(err.index("[worker:1] worker:1 failing on purpose"),
                        err.index("dtrain-run: worker:1 exited"))
        pids = [r[k] for r in reports.values() for k in ("pid", "grandchild_pid")]
        self.assert_gone(pids)

    def test_killed_worker_reports_signal(self):
        p = self.start_launcher(["-np", "2"], self.fake("--sleep", "60"))
        reports = self.wait_reports(["worker:0", "worker:1"])
        os.kill(reports["worker:0"]["pid"], signal.SIGKILL)
        status, _, err = self.finish(p, timeout=20)
        self.assertEqual(status, 128 + 9, err)
        self.assertIn("dtrain-run: worker:0 killed by signal 9 (SIGKILL)\n", err)
        self.assert_gone([reports["worker:1"]["pid"]])

    def test_sigkill_after_grace_when_sigterm_is_ignored(self):
        p = self.start_launcher(["-np", "3", "--grace", "1"], self.fake(
            "--fail-task", "worker:2", "--fail-code", "5", "--fail-after", "0.5",
            "--sleep", "60", "--on-term", "ignore", "--wait-for", "worker:0,worker:1,worker:2"))
        reports = self.wait_reports([f"worker:{i}" for i in range(3)])
        out, err = self.finish_within(p, 6, 5)
        self.assertIn("[worker:0] got SIGTERM", out)
        self.assertIn("worker:0 still running 1 s after SIGTERM; sending SIGKILL", err)
        self.assert_gone([r["pid"] for r in reports.values()])

    def test_a_stopped_worker_gets_its_sigterm_at_once(self):
        # A worker stopped (SIGSTOP: what a hung peer looks like in the fault tests) when another
        # fails: the launcher continues it with its SIGTERM, rather than SIGKILLing it after --grace.
        p = self.start_launcher(["-np", "2", "--grace", "8"], self.fake(
            "--fail-task", "worker:1", "--fail-code", "3", "--fail-after", "3",
            "--sleep", "60", "--on-term", "exit0", "--wait-for", "worker:0,worker:1"))
        reports = self.wait_reports(["worker:0", "worker:1"])
        pid = reports["worker:0"]["pid"]
        os.kill(pid, signal.SIGSTOP)
        self.assertTrue(wait_until(lambda: process_state(pid) == "T", 2), "worker:0 did not stop")
        self.assertIsNone(p.poll(), "the job ended before worker:0 was stopped")
        out, err = self.finish_within(p, 6, 3, "the stopped worker waited for its SIGKILL")
        self.assertIn("[worker:0] got SIGTERM", out)
        self.assertNotIn("SIGKILL", err)
        self.assert_gone([r["pid"] for r in reports.values()])

    def test_relaunched_tasks_get_the_launchers_signal_mask(self):
        # --max-restarts: every launch's tasks start with the signal mask dtrain-run started with
        # (the relaunch's tasks had SIGTERM, SIGINT and SIGHUP blocked: a program without its own
        # sigwait then ignored the forwarded SIGTERM until the SIGKILL after --grace).
        status, _, err, _ = self.run_launcher(["-np", "1", "--max-restarts", "2"], self.fake(
            "--fail-task", "worker:0", "--fail-code", "3"), timeout=30)
        self.assertEqual(status, 3, err)
        masks = [self.report(f"worker:0#{i}")["blocked_signals"] for i in range(3)]
        stops = sum(1 << (s - 1) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD))
        self.assertEqual([m & stops for m in masks], [0, 0, 0], err)
        self.assertEqual(err.count("relaunching all of it"), 2, err)

    def test_timeout_holds_over_every_relaunch(self):
        # Each launch fails after 1 s, then a 1 s pause: --timeout 2.5 ends the job in the second
        # launch, or before the third (each launch had its own 2.5 s: all 6 ran, 12 s).
        status, _, err, secs = self.run_launcher(["-np", "1", "--max-restarts", "5", "--timeout", "2.5"], self.fake(
            "--fail-task", "worker:0", "--fail-code", "3", "--fail-after", "1"), timeout=30)
        self.assertEqual(status, 124, err)
        self.assertLess(secs, 5, err)
        self.assertLessEqual(err.count("relaunching all of it"), 2, err)

    def test_a_stop_signal_before_a_relaunch_ends_the_job(self):
        # Ctrl-C while a failed launch is ending, or in the second before its relaunch: no relaunch.
        p = self.start_launcher(["-np", "1", "--max-restarts", "3"], self.fake(
            "--fail-task", "worker:0", "--fail-code", "3", "--fail-after", "0.3"))
        self.assertTrue(wait_until(lambda: os.path.exists(os.path.join(self.dir, "worker:0.json")), 10))
        time.sleep(0.5)
        p.send_signal(signal.SIGINT)
        status, _, err = self.finish(p, timeout=20)
        self.assertIn(status, (3, 128 + signal.SIGINT), err)
        self.assertFalse(os.path.exists(os.path.join(self.dir, "worker:0#1.json")), err)

    def test_timeout(self):
        status, _, err, secs = self.run_launcher(["-np", "2", "--timeout", "2.5"],
                                                 self.fake("--sleep", "60"), timeout=20)
        self.assertEqual(status, 124, err)
        self.assertIn("timed out after 2.5 s", err)
        self.assertGreaterEqual(secs, 2.4)
        self.assertLess(secs, 8)
        self.assert_gone([self.report(f"worker:{i}")["pid"] for i in range(2)])

    def test_program_not_found(self):
        status, _, err, _ = self.run_launcher(["-np", "2"], ["./no_such_program_xyz"])
        self.assertEqual(status, 127)
        self.assertIn("cannot run './no_such_program_xyz'", err)
        self.assertIn("nothing was started", err)


class Signals(LauncherCase):
    def test_sigterm_is_forwarded(self):
        p = self.start_launcher(["-np", "3"], self.fake("--sleep", "60", "--on-term", "exit0"))
        reports = self.wait_reports([f"worker:{i}" for i in range(3)])
        p.send_signal(signal.SIGTERM)
        status, out, err = self.finish(p, timeout=20)
        self.assertEqual(status, 128 + signal.SIGTERM, err)
        for i in range(3):
            self.assertIn(f"[worker:{i}] got SIGTERM\n", out)
            self.assertTrue(os.path.exists(os.path.join(self.dir, f"worker:{i}.SIGTERM")))
        self.assert_gone([r["pid"] for r in reports.values()])

    def test_sigterm_reaches_the_whole_process_group(self):
        p = self.start_launcher(["-np", "2"], self.fake("--sleep", "60", "--grandchild"))
        reports = self.wait_reports(["worker:0", "worker:1"])
        p.send_signal(signal.SIGTERM)
        status, _, err = self.finish(p, timeout=20)
        self.assertEqual(status, 128 + signal.SIGTERM, err)
        self.assert_gone([r[k] for r in reports.values() for k in ("pid", "grandchild_pid")])

    def test_second_sigint_kills(self):
        p = self.start_launcher(["-np", "2"], self.fake("--sleep", "60", "--on-int", "ignore"))
        reports = self.wait_reports(["worker:0", "worker:1"])
        p.send_signal(signal.SIGINT)
        self.assertTrue(wait_until(lambda: all(
            os.path.exists(os.path.join(self.dir, f"worker:{i}.SIGINT")) for i in range(2)), 10),
            "SIGINT was not forwarded")
        self.assertIsNone(p.poll(), "the tasks ignore SIGINT, so the job goes on")
        p.send_signal(signal.SIGINT)
        status, out, err = self.finish(p, timeout=5)
        self.assertEqual(status, 128 + signal.SIGINT, err)
        self.assertIn("second interrupt", err)
        self.assert_gone([r["pid"] for r in reports.values()])

    def test_a_signal_while_stopping_is_not_forwarded_again(self):
        # worker:1 fails; the launcher sends worker:0 its SIGTERM, which worker:0 takes 2 s to act on
        # (a backup being written). A SIGTERM and a first Ctrl-C sent to the launcher meanwhile must
        # not reach worker:0 again (dtrain's programs take a second stop signal as "die now"), nor
        # kill it: it ends in its own time, and the job with the failure's status.
        p = self.start_launcher(["-np", "2", "--grace", "8"], self.fake(
            "--fail-task", "worker:1", "--fail-code", "3", "--fail-after", "0.5", "--sleep", "60",
            "--on-term", "slow-exit0", "--on-term-tasks", "worker:0", "--term-delay", "2",
            "--wait-for", "worker:0,worker:1"))
        self.wait_reports(["worker:0", "worker:1"])
        self.assertTrue(wait_until(lambda: os.path.exists(os.path.join(self.dir, "worker:0.SIGTERM")), 10),
                        "worker:0 got no SIGTERM after worker:1 failed")
        p.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        p.send_signal(signal.SIGINT)
        status, out, err = self.finish(p, timeout=20)
        self.assertEqual(status, 3, err)
        with open(os.path.join(self.dir, "worker:0.signals")) as f:
            self.assertEqual(f.read().split(), ["SIGTERM"], err)
        self.assertIn("[worker:0] finished 2.0 s after SIGTERM", out)
        self.assertNotIn("second interrupt", err)
        self.assertIn("got SIGTERM while stopping the job", err)

    def discovery_job(self, script_body):
        """An elastic job of one fake worker (sleeping; exits 0 on SIGTERM) whose host discovery
        script runs `script_body`: (the launcher, the script's path, the worker's report)."""
        script = os.path.join(self.dir, "discover.sh")
        with open(script, "w") as f:
            f.write(f"#!/bin/sh\n{script_body}\n")
        os.chmod(script, 0o755)
        p = self.start_launcher(["--min-np", "1", "--max-np", "2", "-np", "1", "--host-discovery-script", script],
                                self.fake("--sleep", "60", "--on-term", "exit0"))
        return p, script, self.wait_reports(["worker:0"])["worker:0"]

    def stop_at_once(self, p):
        """SIGTERM to the launcher, which must end the job with 143 within 5 s: (stdout, stderr)."""
        p.send_signal(signal.SIGTERM)
        return self.finish_within(p, 5, 128 + signal.SIGTERM, "the SIGTERM was not acted on at once")

    def test_a_hung_discovery_script_is_killed_and_the_launcher_goes_on(self):
        # An elastic job's host discovery script that never ends: killed after 10 s, and the job goes
        # on, its output relayed and a SIGTERM acted on at once. It was read in the launcher's loop,
        # which it held for up to 10 s at each run (`timeout 10`): a SIGTERM took 8.9 s to act on.
        p, script, worker = self.discovery_job("echo localhost:2\nexec sleep 100")
        time.sleep(11)
        self.assertIsNone(p.poll(), "the job ended on its own")
        out, err = self.stop_at_once(p)
        self.assertIn("did not finish within 10 s; killed it (SIGKILL)", err)
        self.assertIn("[worker:0] got SIGTERM", out)
        self.assert_gone([worker["pid"]])
        self.assertFalse(subprocess.run(["pgrep", "-f", script], capture_output=True).stdout, "the script lives on")

    def test_a_discovery_script_writing_without_end_is_killed(self):
        # `yes`: the launcher reads at most 64 KiB of it a turn (an unbounded read held its loop for
        # good) and kills it past 1 MiB; the job goes on and a SIGTERM stops it at once.
        p, _, _ = self.discovery_job("exec yes localhost:1")
        time.sleep(3)
        _, err = self.stop_at_once(p)
        self.assertIn("wrote more than 1 MiB; killed it (SIGKILL)", err)

    def test_processes_a_task_leaves_behind_end_with_the_job(self):
        # A task that starts a process with its output elsewhere and exits 0: its pipes close, and
        # the process lived on after dtrain-run returned (a reaped leader's group was never
        # signalled). dtrain-run adopts such orphans (PR_SET_CHILD_SUBREAPER) and ends them.
        status, _, err, secs = self.run_launcher(["-np", "2", "--grace", "1"], self.fake("--orphan"), timeout=30)
        self.assertEqual(status, 0, err)
        pids = [self.report(f"worker:{i}")["orphan_pid"] for i in range(2)]
        self.assertIn("process(es) the tasks left running", err)
        self.assert_gone(pids, timeout=1)
        self.assertLess(secs, 10, err)

    def test_orphans_that_end_while_the_job_runs_are_reaped(self):
        # Adopted orphans that end mid-job are reaped as they end, not kept as zombies until the
        # job's end (they count against the pid limits of a long job).
        p = self.start_launcher(["-np", "1"], self.fake("--short-orphans", "5", "--sleep", "4"))
        self.wait_reports(["worker:0"])
        time.sleep(1.5)
        zombies = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as f:
                        fields = f.read().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                if fields[0] == "Z" and int(fields[1]) == p.pid:
                    zombies.append(int(entry))
        self.assertEqual(zombies, [], "zombie children of dtrain-run while the job runs")
        status, _, err = self.finish(p, timeout=20)
        self.assertEqual(status, 0, err)

    def test_children_it_inherits_through_exec_are_left_alone(self):
        # `cmd & exec dtrain-run ...`: the shell's background child becomes dtrain-run's; it is not
        # an orphan a task left, and lives on after the job.
        pid_file = os.path.join(self.dir, "bg.pid")
        script = (f"sleep 30 >/dev/null 2>&1 & echo $! > {pid_file}; exec {launcher_case.LAUNCHER} -np 1 -- "
                  f"{' '.join(self.fake('--orphan'))}")
        r = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=30)
        self.assertEqual(r.returncode, 0, r.stderr)
        with open(pid_file) as f:
            bg = int(f.read())
        try:
            self.assertTrue(os.path.exists(f"/proc/{bg}"), "the inherited child was ended")
            self.assertIn("ended 1 process(es) the tasks left running", r.stderr)
            self.assert_gone([self.report("worker:0")["orphan_pid"]], timeout=1)
        finally:
            try:
                os.kill(bg, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def test_children_die_with_a_killed_launcher(self):
        p = self.start_launcher(["-np", "2"], self.fake("--sleep", "60"))
        reports = self.wait_reports(["worker:0", "worker:1"])
        p.kill()
        p.communicate(timeout=10)
        self.assert_gone([r["pid"] for r in reports.values()])


class PrintConfig(LauncherCase):
    LINE = re.compile(r"^(\w+):(\d+) (\S+) TF_CONFIG='([^']*)'(.*)$")

    def parse(self, out):
        rows = []
        for line in out.splitlines():
            m = self.LINE.match(line)
            self.assertIsNotNone(m, f"bad line: {line!r}")
            rows.append((m.group(1), int(m.group(2)), m.group(3), json.loads(m.group(4)),
                         m.group(5)))
        return rows

    def test_two_hosts(self):
        status, out, err, _ = self.run_launcher(["--print-config", "-H", "host1:2,host2:2"])
        self.assertEqual(status, 0, err)
        rows = self.parse(out)
        self.assertEqual([(r[0], r[1], r[2]) for r in rows],
                         [("worker", 0, "host1"), ("worker", 1, "host1"),
                          ("worker", 2, "host2"), ("worker", 3, "host2")])
        want = ["host1:23456", "host1:23457", "host2:23456", "host2:23457"]
        for typ, idx, _, cfg, rest in rows:
            self.assertEqual(cfg, {"cluster": {"worker": want},
                                   "task": {"type": typ, "index": idx}})
            self.assertEqual(rest, "")
        self.assertFalse(os.listdir(self.dir), "nothing may be started")

    def test_ps_port_base_and_command(self):
        status, out, err, _ = self.run_launcher(
            ["--print-config", "-np", "2", "--ps", "1", "-H", "a:2,b:2", "--port-base", "30000"],
            ["./prog", "--x=1", "it's"])
        self.assertEqual(status, 0, err)
        rows = self.parse(out)
        self.assertEqual([(r[0], r[1], r[2]) for r in rows],
                         [("worker", 0, "a"), ("worker", 1, "a"), ("ps", 0, "b")])
        self.assertEqual(rows[2][3]["cluster"],
                         {"worker": ["a:30000", "a:30001"], "ps": ["b:30000"]})
        self.assertEqual(rows[0][4], " ./prog --x=1 'it'\\''s'")

    def test_too_many_tasks(self):
        status, _, err, _ = self.run_launcher(["--print-config", "-np", "4", "-H", "h1:1,h2:2"])
        self.assertEqual(status, 2)
        self.assertIn("only 3 slots", err)


class BadUsage(LauncherCase):
    def check(self, args, needle, command=None, want=2):
        status, out, err, _ = self.run_launcher(args, command, timeout=10)
        self.assertEqual(status, want, f"{args}: {err}")
        self.assertIn(needle, err)
        self.assertEqual(out, "")

    def test_no_program(self):
        self.check(["-np", "2"], "put it after --")

    def test_np_below_one(self):
        self.check(["-np", "0"], "-np must be at least 1", ["true"])
        self.check(["-np", "-3"], "-np must be at least 1", ["true"])

    def test_np_missing(self):
        self.check([], "give the number of workers", ["true"])

    def test_malformed_hosts(self):
        for spec in ("host1:x", "host1:2,,host2:2", "host1:0", ":2", "ho st:1", "a:1,a:2"):
            self.check(["--print-config", "-H", spec], "host:slots")

    def test_this_machine_named_twice(self):
        # Slot s of each name would get the same port (port-base + s).
        self.check(["--print-config", "-H", "localhost:1,127.0.0.1:1"],
                   "localhost and 127.0.0.1 are the same host")
        self.check(["-H", f"{socket.gethostname()}:1,localhost:1"], "names this machine twice",
                   ["true"])

    def test_hosts_without_print_config(self):
        self.check(["-np", "2", "-H", "h1:2"], "--print-config", ["true"])

    def test_unknown_option(self):
        self.check(["-np", "2", "--bogus"], "unknown option '--bogus'", ["true"])

    def test_bad_number(self):
        self.check(["-np", "two"], "two", ["true"])

    def test_values_out_of_range(self):
        # Each refused when parsed (a port past 65535 failed only in the tasks; an elastic timeout of
        # 1e10 s overflowed an int).
        for flag, value in (("--port-base", "70000"), ("--port-base", "-5"), ("--elastic-timeout", "1e10"),
                            ("--elastic-settle", "-1")):
            self.check(["-np", "2", flag, value], flag, ["true"])

    def test_restart_workers_needs_ps(self):
        self.check(["-np", "2", "--restart-workers=1"],
                   "--restart-workers needs --ps: synchronous jobs cannot lose a worker", ["true"])
        self.check(["-np", "2", "--ps", "1", "--restart-workers", "-1"], "--restart-workers",
                   ["true"])
        self.check(["--print-config", "-np", "2", "--ps", "1", "--restart-workers", "1",
                    "-H", "h1:3"], "--print-config starts nothing")


if __name__ == "__main__":
    launcher_case.main()
