#!/usr/bin/env python3
"""End-to-end tests of dtrain-run's parameter-server jobs: a failed worker or evaluator does not
stop the job, --restart-workers, the evaluator's stop and grace, a failed ps or chief stops it.

  python3 tests/launcher/launcher_ps_test.py --launcher build/tools/dtrain-run [unittest args...]

Every wait is bounded (launcher_case.py); see launcher_test.py for the other suites.
"""
import json
import os
import signal

import launcher_case
from launcher_case import LauncherCase, wait_until


class PsJob(LauncherCase):
    """Jobs with parameter servers survive a non-chief worker or the evaluator failing."""

    def marker(self, name):
        return os.path.exists(os.path.join(self.dir, name))

    def test_failed_worker_does_not_stop_the_job(self):
        tasks = ["worker:0", "worker:1", "worker:2", "ps:0"]
        status, out, err, _ = self.run_launcher(
            ["-np", "3", "--ps", "1"],
            self.fake("--fail-task", "worker:1", "--fail-code", "3", "--sleep", "60",
                      "--sleep-tasks", "ps:0", "--on-term", "exit0", "--wait-for", ",".join(tasks),
                      # the chief and worker:2 are still running when worker:1 fails
                      "--wait-files", "worker:1.failed", "--wait-files-tasks", "worker:0,worker:2"),
            timeout=40)
        self.assertEqual(status, 0, err)
        self.assertIn("dtrain-run: worker:1 exited with status 3; the parameter-server job "
                      "continues without it (--restart-workers=N restarts it)\n", err)
        self.assertLess(err.index("[worker:1] worker:1 failing on purpose"),
                        err.index("dtrain-run: worker:1 exited"))
        for t in ("worker:0", "worker:2"):
            self.assertFalse(self.marker(f"{t}.SIGTERM"), f"{t} was stopped:\n{out}\n{err}")
            self.assertIn(f"[{t}] hello from {t}\n", out)
        self.assertTrue(self.marker("ps:0.SIGTERM"), "the ps is stopped once the workers are done")
        self.assertIn("all workers finished; stopping 1 parameter server(s) (SIGTERM)", err)
        self.assertNotIn("restarting", err)
        last = err.strip().splitlines()[-1]
        self.assertRegex(last, r"^dtrain-run: the job ran on without worker:1 \(exited with "
                               r"status 3\);.*do not change the exit status")
        self.assert_gone([self.report(t)["pid"] for t in tasks])

    def test_killed_worker_is_restarted_with_the_same_tf_config(self):
        p = self.start_launcher(["-np", "2", "--ps", "1", "--restart-workers=1"], self.fake(
            "--sleep", "60", "--sleep-tasks", "ps:0,worker:1", "--restarted-exit0",
            "--wait-files", "worker:1#1.json", "--wait-files-tasks", "worker:0"))
        first = self.wait_reports(["worker:0", "worker:1", "ps:0"])["worker:1"]
        os.kill(first["pid"], signal.SIGKILL)
        status, out, err = self.finish(p, timeout=30)
        self.assertEqual(status, 0, err)
        self.assertIn("dtrain-run: worker:1 killed by signal 9 (SIGKILL); the parameter-server job "
                      "continues, restarting it in 1 s\n", err)
        self.assertEqual(err.count("dtrain-run: restarting worker:1 (restart 1 of 1)\n"), 1, err)
        self.assertEqual(out.count("[worker:1] hello from worker:1\n"), 2, out)
        self.assertFalse(self.marker("worker:1#2.json"), "restarted more than once")
        again = self.report("worker:1#1")
        self.assertEqual((first["instance"], again["instance"]), (0, 1))
        self.assertNotEqual(again["pid"], first["pid"])
        for key in ("tf_config", "token", "argv", "task"):
            self.assertEqual(again[key], first[key], key)
        self.assertEqual(json.loads(again["tf_config"])["task"], {"type": "worker", "index": 1})
        self.assertFalse(self.marker("worker:0.SIGTERM"))
        self.assertNotIn("ran on without", err)  # restarted, so nothing was lost
        self.assert_gone([again["pid"], self.report("ps:0")["pid"]])

    def test_restarts_are_bounded(self):
        status, out, err, _ = self.run_launcher(
            ["-np", "2", "--ps", "1", "--restart-workers", "2"],
            self.fake("--fail-task", "worker:1", "--fail-code", "3", "--sleep", "60",
                      "--sleep-tasks", "ps:0", "--wait-files", "worker:1#2.json",
                      "--wait-files-tasks", "worker:0"), timeout=40)
        self.assertEqual(status, 0, err)
        self.assertEqual(out.count("[worker:1] hello from worker:1\n"), 3, out)
        for n in (1, 2):
            self.assertIn(f"dtrain-run: restarting worker:1 (restart {n} of 2)\n", err)
        self.assertNotIn("restart 3", err)
        self.assertIn("dtrain-run: worker:1 exited with status 3; the parameter-server job "
                      "continues without it (no restarts left of --restart-workers=2)\n",
                      err)
        self.assertIn("the job ran on without worker:1 (exited with status 3)", err)

    def test_failed_evaluator_does_not_stop_the_job(self):
        status, out, err, _ = self.run_launcher(
            ["-np", "2", "--ps", "1", "--evaluator", "--restart-workers", "1"],
            self.fake("--fail-task", "evaluator:0", "--fail-code", "7", "--sleep", "60",
                      "--sleep-tasks", "ps:0", "--wait-files", "evaluator:0.failed",
                      "--wait-reaped", "evaluator:0", "--wait-files-tasks", "worker:0,worker:1"),
            timeout=40)
        self.assertEqual(status, 0, err)
        self.assertIn("dtrain-run: evaluator:0 exited with status 7; the parameter-server job "
                      "continues without it\n", err)  # evaluators are not restarted
        self.assertNotIn("restarting", err)
        self.assertIn("the job ran on without evaluator:0 (exited with status 7)", err)

    def test_running_evaluator_is_stopped_after_the_workers(self):
        status, out, err, _ = self.run_launcher(
            ["-np", "1", "--ps", "1", "--evaluator"],
            self.fake("--sleep", "60", "--sleep-tasks", "ps:0,evaluator:0", "--on-term", "exit0",
                      "--wait-for", "worker:0,ps:0,evaluator:0"), timeout=30)
        self.assertEqual(status, 0, err)
        self.assertIn("all workers finished; stopping 1 parameter server(s) and the evaluator "
                      "(SIGTERM; the evaluator finishes the newest checkpoint, SIGKILL after 300 s "
                      "(--evaluator-grace))", err)
        self.assertTrue(self.marker("evaluator:0.SIGTERM"))
        self.assertTrue(self.marker("ps:0.SIGTERM"))

    def test_evaluator_dying_of_its_sigterm_is_reported(self):
        # An evaluator still starting (no handler yet) or crashing while it evaluates the final
        # checkpoint: the job's status stays the chief's, but the launcher says so.
        status, out, err, _ = self.run_launcher(
            ["-np", "1", "--ps", "1", "--evaluator"],
            self.fake("--sleep", "60", "--sleep-tasks", "ps:0,evaluator:0", "--on-term", "exit0",
                      "--on-term-tasks", "ps:0", "--wait-for", "worker:0,ps:0,evaluator:0"),
            timeout=30)
        self.assertEqual(status, 0, err)
        self.assertIn("dtrain-run: evaluator:0 killed by signal 15 (SIGTERM) after its SIGTERM; the "
                      "newest checkpoint may not have been evaluated", err)
        self.assertNotIn("ps:0 killed", err)

    def test_evaluator_finishing_its_last_checkpoint_outlives_the_grace(self):
        # After the workers, the evaluator's SIGTERM means "evaluate the newest checkpoint, then
        # exit"; on a loaded machine that takes longer than --grace, and a SIGKILL then would lose
        # the final checkpoint's evaluation (ps_Basics saw this under CI load).
        status, out, err, _ = self.run_launcher(
            ["-np", "1", "--ps", "1", "--evaluator", "--grace", "1"],
            self.fake("--sleep", "60", "--sleep-tasks", "ps:0,evaluator:0", "--on-term", "slow-exit0",
                      "--term-delay", "3", "--wait-for", "worker:0,ps:0,evaluator:0"), timeout=30)
        self.assertEqual(status, 0, err)
        self.assertIn("SIGKILL after 300 s (--evaluator-grace)", err)
        self.assertIn("[evaluator:0] finished 3.0 s after SIGTERM", out)
        self.assertNotIn("evaluator:0 still running", err)

    def test_a_sigterm_while_the_evaluator_finishes_is_not_passed_on_again(self):
        # The workers are done and the evaluator has its SIGTERM ("evaluate the last checkpoint");
        # a SIGTERM to the launcher then must not reach it again (dtrain's programs take a second
        # stop signal as "die now": it was sent again), only bring its SIGKILL to --grace.
        p = self.start_launcher(["-np", "1", "--ps", "1", "--evaluator", "--grace", "8"], self.fake(
            "--sleep", "60", "--sleep-tasks", "ps:0,evaluator:0", "--on-term", "slow-exit0",
            "--on-term-tasks", "evaluator:0", "--term-delay", "2", "--wait-for", "worker:0,ps:0,evaluator:0"))
        self.assertTrue(wait_until(lambda: self.marker("evaluator:0.SIGTERM"), 20), "no SIGTERM for the evaluator")
        p.send_signal(signal.SIGTERM)
        status, out, err = self.finish(p, timeout=20)
        with open(os.path.join(self.dir, "evaluator:0.signals")) as f:
            self.assertEqual(f.read().split(), ["SIGTERM"], err)
        self.assertIn("[evaluator:0] finished 2.0 s after SIGTERM", out)

    def test_evaluator_grace_is_bounded(self):
        status, out, err, _ = self.run_launcher(
            ["-np", "1", "--ps", "1", "--evaluator", "--grace", "1", "--evaluator-grace", "1"],
            self.fake("--sleep", "60", "--sleep-tasks", "ps:0,evaluator:0", "--on-term", "slow-exit0",
                      "--term-delay", "20", "--wait-for", "worker:0,ps:0,evaluator:0"), timeout=30)
        self.assertEqual(status, 0, err)  # the chief and the ps decide a ps job's status
        self.assertIn("evaluator:0 still running 1 s after SIGTERM; sending SIGKILL", err)
        self.assertNotIn("[evaluator:0] finished", out)

    def test_failed_ps_stops_the_job(self):
        tasks = ["worker:0", "worker:1", "ps:0"]
        p = self.start_launcher(["-np", "2", "--ps", "1", "--restart-workers", "1"], self.fake(
            "--fail-task", "ps:0", "--fail-code", "4", "--fail-after", "0.3", "--sleep", "60",
            "--wait-for", ",".join(tasks)))
        reports = self.wait_reports(tasks)
        out, err = self.finish_within(p, 6, 4)
        self.assertIn("dtrain-run: ps:0 exited with status 4\n", err)
        self.assertNotIn("restarting", err)
        self.assertNotIn("continues", err)
        self.assert_gone([r["pid"] for r in reports.values()])

    def test_failed_chief_stops_the_job(self):
        tasks = ["worker:0", "worker:1", "worker:2", "ps:0"]
        p = self.start_launcher(["-np", "3", "--ps", "1", "--restart-workers", "2"], self.fake(
            "--fail-task", "worker:0", "--fail-code", "6", "--fail-after", "0.3", "--sleep", "60",
            "--wait-for", ",".join(tasks)))
        reports = self.wait_reports(tasks)
        status, out, err = self.finish(p, timeout=20)
        self.assertEqual(status, 6, err)
        self.assertIn("dtrain-run: worker:0 exited with status 6\n", err)
        self.assertEqual(err.count("dtrain-run: "), 1, err)
        self.assert_gone([r["pid"] for r in reports.values()])

    def test_killed_chief_stops_the_job(self):
        p = self.start_launcher(["-np", "2", "--ps", "1", "--restart-workers", "1"],
                                self.fake("--sleep", "60"))
        reports = self.wait_reports(["worker:0", "worker:1", "ps:0"])
        os.kill(reports["worker:0"]["pid"], signal.SIGKILL)
        status, _, err = self.finish(p, timeout=20)
        self.assertEqual(status, 128 + 9, err)
        self.assertIn("dtrain-run: worker:0 killed by signal 9 (SIGKILL)\n", err)
        self.assertNotIn("restarting", err)
        self.assert_gone([reports[t]["pid"] for t in ("worker:1", "ps:0")])

    def test_no_restart_once_the_job_is_stopping(self):
        p = self.start_launcher(["-np", "2", "--ps", "1", "--restart-workers", "1"],
                                self.fake("--sleep", "60"))
        reports = self.wait_reports(["worker:0", "worker:1", "ps:0"])
        os.kill(reports["worker:1"]["pid"], signal.SIGKILL)
        p.send_signal(signal.SIGTERM)  # within the restart delay
        status, out, err = self.finish(p, timeout=20)
        self.assertEqual(status, 128 + signal.SIGTERM, err)
        self.assertNotIn("restarting worker:1", err)
        self.assertEqual(out.count("[worker:1] hello from worker:1\n"), 1, out)
        self.assert_gone([reports[t]["pid"] for t in ("worker:0", "ps:0")])

    def test_without_ps_a_failed_evaluator_stops_the_job(self):
        p = self.start_launcher(["-np", "2", "--evaluator"], self.fake(
            "--fail-task", "evaluator:0", "--fail-code", "7", "--fail-after", "0.3",
            "--sleep", "60", "--wait-for", "worker:0,worker:1,evaluator:0"))
        reports = self.wait_reports(["worker:0", "worker:1", "evaluator:0"])
        status, _, err = self.finish(p, timeout=20)
        self.assertEqual(status, 7, err)
        self.assertIn("dtrain-run: evaluator:0 exited with status 7\n", err)
        self.assertNotIn("continues", err)
        self.assert_gone([r["pid"] for r in reports.values()])


if __name__ == "__main__":
    launcher_case.main()
