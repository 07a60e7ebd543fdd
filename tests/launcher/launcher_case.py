"""What the dtrain-run tests share (launcher_test.py, launcher_ps_test.py): the fake worker's
command, bounded waits on processes, and LauncherCase, which starts dtrain-run (LAUNCHER, set by
each test file's main) and kills whatever a test leaves running.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
FAKE = os.path.join(HERE, "fake_worker.py")
LAUNCHER = None  # set by main()
HEX64 = re.compile(r"^[0-9a-f]{64}$")


def process_state(pid):
    """The state letter of `pid` in /proc (R, S, T, Z...), or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None


def pid_alive(pid):
    """True while `pid` exists and is not a zombie."""
    return process_state(pid) not in (None, "Z")


def wait_until(cond, timeout, step=0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(step)
    return cond()


class LauncherCase(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory(prefix="dtrain_run_test_")
        self.dir = self.tmp.name
        self.procs = []

    def tearDown(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
        self.tmp.cleanup()

    def fake(self, *args):
        return [sys.executable, FAKE, "--report-dir", self.dir, *args]

    def run_launcher(self, launcher_args, command=None, timeout=30, env=None):
        """Runs dtrain-run to completion; returns (status, stdout, stderr, seconds)."""
        cmd = [LAUNCHER, *launcher_args] + (["--", *command] if command else [])
        start = time.monotonic()
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired as e:
            self.fail(f"dtrain-run did not finish within {timeout} s: {cmd}\n"
                      f"{e.stdout}\n{e.stderr}")
        return r.returncode, r.stdout, r.stderr, time.monotonic() - start

    def start_launcher(self, launcher_args, command):
        p = subprocess.Popen([LAUNCHER, *launcher_args, "--", *command], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        self.procs.append(p)
        return p

    def finish(self, p, timeout):
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate(timeout=10)
            self.fail(f"dtrain-run did not exit within {timeout} s\n{out}\n{err}")
        return p.returncode, out, err

    def finish_within(self, p, seconds, status, why="should stop within a few seconds"):
        """finish(), which must end with `status` within `seconds` from now: (stdout, stderr)."""
        t0 = time.monotonic()
        code, out, err = self.finish(p, timeout=20)
        self.assertEqual(code, status, err)
        self.assertLess(time.monotonic() - t0, seconds, f"{why}\n{err}")
        return out, err

    def report(self, task):
        with open(os.path.join(self.dir, f"{task}.json")) as f:
            return json.load(f)

    def wait_reports(self, tasks, timeout=20):
        ok = wait_until(lambda: all(os.path.exists(os.path.join(self.dir, f"{t}.json"))
                                    for t in tasks), timeout)
        self.assertTrue(ok, f"not all of {tasks} started within {timeout} s")
        return {t: self.report(t) for t in tasks}

    def assert_gone(self, pids, timeout=5):
        ok = wait_until(lambda: not any(pid_alive(p) for p in pids), timeout)
        self.assertTrue(ok, f"processes still alive: {[p for p in pids if pid_alive(p)]}")


def main():
    """A test file's entry point: --launcher (dtrain-run) sets LAUNCHER; the rest is unittest's."""
    global LAUNCHER
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--launcher", required=True)
    known, rest = ap.parse_known_args()
    LAUNCHER = os.path.abspath(known.launcher)
    unittest.main(module="__main__", argv=[sys.argv[0], *rest], verbosity=2)
