#!/usr/bin/env python3
"""A stand-in for a dtrain task, started by dtrain-run in tests/launcher/launcher_test.py
(and launcher_ps_test.py).

It reports what the launcher gave it (TF_CONFIG, DTRAIN_TASK, DTRAIN_JOB_TOKEN, argv, pid) as
<report-dir>/<task>.json, and as <task>#<n>.json for its n-th start (0, then 1 after a restart),
prints a line to stdout and to stderr, then behaves as asked: fail with a status (leaving
<task>.failed just before), sleep, start a grandchild, catch or ignore signals, wait for other
tasks' files. Every sleep and wait is bounded.
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import time


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--report-dir", required=True)
    p.add_argument("--fail-task", default="", help="task that exits with --fail-code")
    p.add_argument("--fail-code", type=int, default=3)
    p.add_argument("--fail-after", type=float, default=0.0)
    p.add_argument("--sleep", type=float, default=0.0, help="then exit 0")
    p.add_argument("--sleep-tasks", default="", help="only these tasks sleep (comma-separated)")
    p.add_argument("--wait-for", default="", help="first wait (<= 20 s) for these tasks' reports")
    p.add_argument("--wait-files", default="",
                   help="then wait (<= 20 s) for these files in the report dir (comma-separated)")
    p.add_argument("--wait-files-tasks", default="", help="only these tasks wait for --wait-files")
    p.add_argument("--wait-reaped", default="",
                   help="then wait (<= 20 s; only the tasks --wait-files-tasks names, if given) "
                        "until the launcher has reaped these tasks (their reported pids are "
                        "gone), so it has seen their exits before this task's")
    p.add_argument("--restarted-exit0", action="store_true",
                   help="a restarted start (n >= 1) reports, prints and exits 0")
    p.add_argument("--grandchild", action="store_true", help="start a `sleep` in the same group")
    p.add_argument("--short-orphans", type=int, default=0,
                   help="leave this many `sleep 0.1`s behind (double-forked: orphans that end "
                        "while the task runs)")
    p.add_argument("--orphan", action="store_true",
                   help="start a `sleep` in the same group with its output to /dev/null (the task's "
                        "pipes close when the task exits, leaving it behind)")
    p.add_argument("--on-term", choices=["default", "exit0", "ignore", "slow-exit0"], default="default",
                   help="slow-exit0: exit 0 --term-delay seconds after the signal (an evaluator "
                        "finishing its last checkpoint)")
    p.add_argument("--on-term-tasks", default="", help="only these tasks use --on-term (comma-separated)")
    p.add_argument("--term-delay", type=float, default=3.0)
    p.add_argument("--on-int", choices=["default", "exit0", "ignore"], default="default")
    p.add_argument("--lines", type=int, default=0, help="extra numbered stdout lines")
    p.add_argument("--partial", action="store_true", help="end stdout without a newline")
    args, rest = p.parse_known_args()

    task = os.environ.get("DTRAIN_TASK", "?")

    def pid_alive(other):
        """True until `other`'s reported process is reaped (a zombie still answers signal 0)."""
        try:
            with open(os.path.join(args.report_dir, f"{other}.json")) as f:
                os.kill(json.load(f)["pid"], 0)
        except ProcessLookupError:
            return False
        except (OSError, ValueError, KeyError):
            pass  # no report yet: keep waiting (bounded by the caller's deadline)
        return True
    grandchild = None
    if args.grandchild:
        grandchild = subprocess.Popen(["sleep", "60"])
    for _ in range(args.short_orphans):
        subprocess.run(["sh", "-c", "(sleep 0.1 &)"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       timeout=10)
    orphan = None
    if args.orphan:
        orphan = subprocess.Popen(["sleep", "60"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def handler(signum, _frame):
        name = signal.Signals(signum).name
        sys.stdout.write(f"got {name}\n")
        sys.stdout.flush()
        with open(os.path.join(args.report_dir, f"{task}.{name}"), "w") as f:
            f.write("1")
        with open(os.path.join(args.report_dir, f"{task}.signals"), "a") as f:  # every one, in order
            f.write(name + "\n")
        mode = args.on_term if signum == signal.SIGTERM else args.on_int
        if mode == "exit0":
            os._exit(0)
        if mode == "slow-exit0":
            time.sleep(args.term_delay)
            sys.stdout.write(f"finished {args.term_delay} s after {name}\n")
            sys.stdout.flush()
            os._exit(0)

    if args.on_term_tasks and task not in args.on_term_tasks.split(","):
        args.on_term = "default"
    for sig, mode in ((signal.SIGTERM, args.on_term), (signal.SIGINT, args.on_int)):
        if mode != "default":
            signal.signal(sig, handler)

    # Before the report, so a test that acts on the report (or a launcher stopping the task once
    # the others are done) never misses these lines.
    print(f"hello from {task}", flush=True)
    print(f"error stream of {task}", file=sys.stderr, flush=True)
    instance = sum(1 for f in os.listdir(args.report_dir)
                   if f.startswith(f"{task}#") and f.endswith(".json"))
    report = {
        "task": task,
        "instance": instance,
        "tf_config": os.environ.get("TF_CONFIG"),
        "token": os.environ.get("DTRAIN_JOB_TOKEN"),
        "cpus": sorted(os.sched_getaffinity(0)),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "local_rank": os.environ.get("LOCAL_RANK"),
        "local_world_size": os.environ.get("LOCAL_WORLD_SIZE"),
        "argv": sys.argv[1:],
        "extra_args": rest,
        "pid": os.getpid(),
        "grandchild_pid": grandchild.pid if grandchild else None,
        "orphan_pid": orphan.pid if orphan else None,
        "stdin_is_devnull": os.path.samestat(os.fstat(0), os.stat(os.devnull)),
        "blocked_signals": [int(l.split()[1], 16) for l in open("/proc/self/status") if l.startswith("SigBlk:")][0],
    }
    for name in (f"{task}#{instance}.json", f"{task}.json"):
        tmp = os.path.join(args.report_dir, f".{task}.tmp")
        with open(tmp, "w") as f:
            json.dump(report, f)
        os.rename(tmp, os.path.join(args.report_dir, name))  # appears whole

    for i in range(args.lines):
        sys.stdout.write(f"line {i} of {task} " + "x" * (i % 300) + "\n")
    sys.stdout.flush()

    others = [t for t in args.wait_for.split(",") if t and t != task]
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not all(
            os.path.exists(os.path.join(args.report_dir, f"{t}.json")) for t in others):
        time.sleep(0.02)

    if instance >= 1 and args.restarted_exit0:
        return

    files = [f for f in args.wait_files.split(",") if f]
    if files and (not args.wait_files_tasks or task in args.wait_files_tasks.split(",")):
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not all(
                os.path.exists(os.path.join(args.report_dir, f)) for f in files):
            time.sleep(0.02)

    reaped = [t for t in args.wait_reaped.split(",") if t and t != task]
    if reaped and (not args.wait_files_tasks or task in args.wait_files_tasks.split(",")):
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(pid_alive(t) for t in reaped):
            time.sleep(0.02)

    if task == args.fail_task:
        time.sleep(args.fail_after)
        print(f"{task} failing on purpose", file=sys.stderr, flush=True)
        with open(os.path.join(args.report_dir, f"{task}.failed"), "w") as f:
            f.write(str(args.fail_code))
        sys.exit(args.fail_code)
    if args.sleep > 0 and (not args.sleep_tasks or task in args.sleep_tasks.split(",")):
        deadline = time.monotonic() + args.sleep
        while time.monotonic() < deadline:
            time.sleep(0.05)  # a handler that does not exit returns here
    if args.partial:
        sys.stdout.write(f"no newline from {task}")
        sys.stdout.flush()
    if grandchild:
        grandchild.kill()
        grandchild.wait()


if __name__ == "__main__":
    main()
