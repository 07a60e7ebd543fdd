#!/usr/bin/env python3
"""A peer that dies or hangs while ResNet-50's 25.6 million gradients (102 MB a step) are in flight.

The multi-worker fault tests (tests/multiworker) use a model of 225 thousand parameters, whose
gradients go in one all-reduce after the backward pass. ResNet-50's are fused into packs, each
all-reduced on the collective thread as soon as the backward pass has produced it
(MirroredOptions::bytes_per_pack, overlap_backward), so a peer's death mostly reaches the training
thread from another thread, in the middle of a pack (each case prints which all-reduce failed).
Two workers of examples/synthetic_benchmark (TF_CONFIG on 127.0.0.1; images of 32x32, so that a
step is short and most of it is the all-reduce); worker 1 is killed (SIGKILL) or stopped (SIGSTOP)
mid-benchmark, with the data over shared memory (the default between ranks of one host) and over
the sockets (DTRAIN_SHARED_MEMORY=0, as between hosts), with one replica a worker and with two
(--devices=cpu:2: the second replica waits on the first's stage across workers). Worker 0 must
exit with 1 within 30 s, its last line the typed error naming worker:1 and what happened to it; a
hang fails the test. A failed step used to remake its group while packs were still queued (a hang
or a SIGSEGV in 5 of 8 runs beside two CPU burners), and with two replicas a worker the second
replica failed with a "collective mismatch" that hid the dead worker.
  synthetic_benchmark_faults_test.py SYNTHETIC_BENCHMARK
"""
import json, os, signal, subprocess, sys, threading, time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "testing"))
from ports import free_ports  # noqa: E402

ARGS = ["--model=resnet50", "--image-size=32", "--batch-size=2", "--num-warmup-batches=2",
        "--num-batches-per-iter=5", "--num-iters=1000", "--threads=1", "--strategy=multi_worker_mirrored"]


class Worker:
    """A worker whose stdout is read as it comes (so its pipe never fills), lines kept."""

    def __init__(self, bench, ports, index, shared_memory, replicas):
        tf_config = {"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
                     "task": {"type": "worker", "index": index}}
        env = dict(os.environ, TF_CONFIG=json.dumps(tf_config), DTRAIN_JOB_TOKEN="synthetic-faults-token-0123",
                   DTRAIN_HEARTBEAT_TIMEOUT="2", DTRAIN_RENDEZVOUS_TIMEOUT="30",
                   DTRAIN_SHARED_MEMORY="1" if shared_memory else "0")
        # a session of its own: the finally below kills the worker's whole group
        self.p = subprocess.Popen([bench] + ARGS + [f"--devices=cpu:{replicas}"], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, start_new_session=True)
        self.lines, self.err = [], []
        self.threads = [threading.Thread(target=self._read, args=(self.p.stdout, self.lines), daemon=True),
                        threading.Thread(target=self._read, args=(self.p.stderr, self.err), daemon=True)]
        for t in self.threads:
            t.start()

    @staticmethod
    def _read(pipe, into):
        for line in pipe:
            into.append(line)

    def wait_for_iters(self, n, timeout):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if sum(l.startswith("Iter #") for l in self.lines) >= n:
                return
            if self.p.poll() is not None:
                sys.exit(f"the worker exited ({self.p.returncode}) before training:\n{''.join(self.err)[-2000:]}")
            time.sleep(0.05)
        sys.exit(f"no {n} benchmark iterations in {timeout} s:\n{''.join(self.lines)[-2000:]}")

    def finish(self, timeout):
        try:
            self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait(10)
            return None
        for t in self.threads:
            t.join(10)
        return self.p.returncode

    def reap(self):
        try:
            os.killpg(self.p.pid, signal.SIGKILL)  # a stopped process dies of SIGKILL too
        except ProcessLookupError:
            pass
        self.p.wait(10)


def case(bench, sig, shared_memory, expect, replicas=1):
    name = (f"{sig.name} over {'shared memory' if shared_memory else 'the sockets'}"
            f"{f', {replicas} replicas a worker' if replicas > 1 else ''}")
    ports = free_ports(2)
    workers = [Worker(bench, ports, i, shared_memory, replicas) for i in range(2)]
    try:
        workers[0].wait_for_iters(2, 90)  # each iteration is 5 steps: 10 all-reduces of 102 MB done
        if workers[1].p.poll() is not None:
            sys.exit(f"worker 1 ended before it could be signalled ({workers[1].p.returncode})")
        workers[1].p.send_signal(sig)
        t0 = time.time()
        code = workers[0].finish(30)
        took = time.time() - t0
        err = "".join(workers[0].err)
        if code is None:
            sys.exit(f"{name}: worker 0 did not exit within 30 s of worker 1's {sig.name} (hung); "
                     f"killed it. stderr:\n{err[-2000:]}")
        if code != 1:  # main's catch: the error printed, exit 1 (not a crash after it)
            sys.exit(f"{name}: worker 0 exited {code}, not 1, after its peer's {sig.name}:\n{err[-2000:]}")
        lines = err.strip().splitlines()
        last = lines[-1] if lines else ""
        for words in ["error: Unavailable: ", "worker:1"] + expect:
            if words not in last:
                sys.exit(f"{name}: worker 0's last line does not say {words!r}:\n{err[-2000:]}")
        print(f"ok: {name}: worker 0 exited {code} {took:.2f} s after worker 1's {sig.name}, "
              f"after {sum(l.startswith('Iter #') for l in workers[0].lines)} iterations: {last}")
    finally:
        for w in workers:
            w.reap()


def main():
    bench = sys.argv[1]
    killed = ["closed", "that task died, was killed, or aborted the job"]
    stopped = ["sent nothing, not even a heartbeat", "it is hung"]
    for shared_memory in (True, False):
        case(bench, signal.SIGKILL, shared_memory, killed)
        case(bench, signal.SIGSTOP, shared_memory, stopped)
    # Two replicas a worker (the hierarchical all-reduce: within the worker, then across): the
    # second replica waits for the first's stage across workers, and must fail with its error.
    case(bench, signal.SIGKILL, True, killed, replicas=2)
    case(bench, signal.SIGSTOP, True, stopped, replicas=2)


if __name__ == "__main__":
    main()
