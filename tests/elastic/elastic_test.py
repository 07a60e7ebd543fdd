#!/usr/bin/env python3
"""Elastic training: dtrain-run --min-np/--max-np with dtrain::elastic (examples/elastic_fashion_mnist).

  elastic_test.py local DTRAIN_RUN EXAMPLE
  elastic_test.py netns DTRAIN_RUN EXAMPLE DTRAIN_NETNS      (root; exits 77 where namespaces cannot be made)

Both modes run the same job twice, 3 workers of a possible 2..3, 5 epochs of 12,480 Fashion-MNIST images
at a global batch of 96 (650 optimizer steps):
  - undisturbed, as the reference;
  - disturbed: a worker is lost while training (local: kill -9 of rank 0, which holds the committed
    state; netns: worker 2's host is removed, i.e. dropped from the discovery script's list and its
    link cut), the survivors must roll back
    to their last commit and go on as a round of 2; then a slot (local) or a new host (netns) is listed
    and the new worker must be taken in, with the committed state, as a round of 3.
The disturbed job must exit 0 after exactly 650 optimizer steps (nothing lost, nothing applied twice),
through rounds of 3, 2 and 3 workers, with test accuracy within 1.5 points of the reference, the
learning rate of its LearningRateScheduler (x0.8 an epoch) equal to the reference's, and every worker
of the last round holding the same rate and weights (after EarlyStopping put back the best epoch's,
which the commits carry). Local mode also checks that workers keeping different callbacks' states
are refused at the first commit.
Local mode also checks the failures: a job that falls below --min-np ends non-zero within the elastic
timeout, naming the reason, and bad flags are refused with exit status 2.
"""
import json, os, re, signal, struct, subprocess, sys, tempfile, time

mode, dtrain_run, example = sys.argv[1:4]
netns = sys.argv[4] if len(sys.argv) > 4 else None
prefix = f"de{os.getpid() % 10000}"
work = tempfile.mkdtemp(prefix="dtrain-elastic-")
EPOCHS, IMAGES = 5, 12480
LR, DECAY = 1e-3, 0.8  # the example's Adam rate, and --lr-decay: a LearningRateScheduler
# --patience 3: an EarlyStopping whose state (the best epoch's weights too) goes with the commits.
ARGS = ["--train-limit", str(IMAGES), "--epochs", str(EPOCHS), "--batch-size", "96", "--lr-decay", str(DECAY),
        "--patience", "3", "--json"]
STEPS = EPOCHS * IMAGES // 96

def fail(msg):
    raise SystemExit("FAILED: " + msg)

def discovery(lines):
    path = os.path.join(work, "hosts")
    with open(path + ".tmp", "w") as f:
        f.write("".join(l + "\n" for l in lines))
    os.replace(path + ".tmp", path)

def start(np_, extra=(), settle="3", example_args=(), args=ARGS):
    script = os.path.join(work, "discover.sh")
    with open(script, "w") as f:
        f.write(f"#!/bin/sh\ncat {os.path.join(work, 'hosts')}\n")
    os.chmod(script, 0o755)
    where = ["--netns", prefix] if mode == "netns" else []
    cmd = [dtrain_run, *where, "--min-np", "2", "--max-np", "3", "-np", str(np_), "--host-discovery-script", script,
           "--elastic-settle", settle, "--elastic-timeout", "6", "--timeout", "240", *extra, "--", example, *args, *example_args]
    out, err = open(os.path.join(work, "out"), "w+"), open(os.path.join(work, "err"), "w+")
    return subprocess.Popen(cmd, stdout=out, stderr=err), out, err

def text(f):
    f.flush(); f.seek(0); return f.read()

def wait_for(err, pattern, proc, limit=120):
    t0 = time.time()
    while time.time() - t0 < limit:
        m = re.search(pattern, text(err))
        if m: return m
        if proc.poll() is not None: fail(f"the job ended before '{pattern}':\n{text(err)[-3000:]}")
        time.sleep(0.1)
    fail(f"no '{pattern}' within {limit} s:\n{text(err)[-3000:]}")

def pid_of(elastic_id, rendezvous):
    for p in os.listdir("/proc"):
        if not p.isdigit(): continue
        try:
            env = open(f"/proc/{p}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        if f"DTRAIN_ELASTIC_ID={elastic_id}".encode() in env and f"DTRAIN_ELASTIC_RENDEZVOUS={rendezvous}".encode() in env:
            return int(p)
    return None

def finish(proc, out, err, what):
    try:
        proc.wait(timeout=240)
    except subprocess.TimeoutExpired:
        proc.kill(); fail(f"{what}: dtrain-run did not end (hang)")
    o, e = text(out), text(err)
    if proc.returncode != 0: fail(f"{what}: exit {proc.returncode}\n{e[-4000:]}")
    results = [json.loads(l.split("] ", 1)[-1]) for l in o.splitlines() if "] {" in l]
    if len(results) != 1: fail(f"{what}: expected one JSON result, got {len(results)}:\n{o[-2000:]}")
    return results[0], e

def hosts(n):
    return [f"{prefix}-h{i}:1" for i in range(n)] if mode == "netns" else [f"localhost:{n}"]

def run_reference():
    discovery(hosts(3))
    proc, out, err = start(3)
    r, _ = finish(proc, out, err, "undisturbed job")
    if r["resets"] != 0 or r["workers"] != 3 or r["optimizer_steps"] != STEPS: fail(f"undisturbed job: {r}")
    if not r["workers_agree"]: fail(f"undisturbed job: the workers hold different rates or weights: {r}")
    if abs(r["learning_rate"] / (LR * DECAY ** EPOCHS) - 1) > 1e-6:
        fail(f"undisturbed job: final learning rate {r['learning_rate']!r}, expected {LR * DECAY ** EPOCHS!r}")
    print(f"undisturbed: {r}")
    return r

def run_disturbed(ref, sharding=None):
    what = "disturbed job" + (f" (--sharding {sharding})" if sharding else "")
    discovery(hosts(3))
    proc, out, err = start(3, example_args=["--sharding", sharding] if sharding else [])
    rdzv = wait_for(err, r"rendezvous at (\S+)", proc).group(1)
    wait_for(err, rf"\[worker:0\] Epoch 2/{EPOCHS}", proc)  # well into training, with commits behind it
    t_lost = time.time()
    if mode == "local":
        # Rank 0 itself, the worker that holds the job's committed state and prints the result: a
        # survivor must take its place and broadcast the state it committed.
        discovery(["localhost:2"])  # no slot for a replacement yet
        victim = pid_of(0, rdzv)
        if victim is None: fail("cannot find worker 0's process")
        os.kill(victim, signal.SIGKILL)
    else:
        discovery([f"{prefix}-h0:1", f"{prefix}-h1:1"])  # host 2 is removed...
        subprocess.run([netns, "link", "--prefix", prefix, "2", "--down"], check=True, capture_output=True)  # ...and cut off
    wait_for(err, r"round 2, 2 workers", proc)
    reform_s = time.time() - t_lost
    # A new slot: a new worker starts, receives the committed state and is taken in.
    discovery([f"{prefix}-h0:1", f"{prefix}-h1:1", f"{prefix}-h3:1"] if mode == "netns" else ["localhost:3"])
    wait_for(err, r"round 3, 3 workers", proc)
    r, e = finish(proc, out, err, what)
    # RunOptions::on_reset runs on the newcomer too (launcher id 3 locally, the worker on host 3 in netns).
    if not re.search(r"\[worker:3\][^\n]*elastic: round 3, 3 workers", e):
        fail(f"{what}: the new worker did not run on_reset:\n{e[-3000:]}")
    print(f"{what}: {r}; re-formed as 2 workers {reform_s:.1f} s after the loss")
    if r["resets"] != 2 or r["rounds"] != 3 or r["workers"] != 3: fail(f"{what}: expected rounds 3/2/3 and 2 resets: {r}")
    if r["optimizer_steps"] != STEPS: fail(f"{what} applied {r['optimizer_steps']} steps, expected {STEPS}")
    # The scheduler's state went with the commits: neither applied twice on the survivors at the
    # resumed epoch nor started afresh on the newcomer (whose weights would then drift away).
    if r["learning_rate"] != ref["learning_rate"]:
        fail(f"{what}: final learning rate {r['learning_rate']!r}, undisturbed {ref['learning_rate']!r}")
    if not r["workers_agree"]: fail(f"{what}: the last round's workers hold different rates or weights")
    if abs(r["test_accuracy"] - ref["test_accuracy"]) > 0.015:
        fail(f"test accuracy {r['test_accuracy']:.4f} vs undisturbed {ref['test_accuracy']:.4f}")
    if mode == "netns" and "worker:3 on " + f"{prefix}-h3" not in e: fail("the new worker did not start on the new host")
    for needle in ["HostsUpdated", "rejoining"]:
        if needle not in e: fail(f"'{needle}' missing from the log")

def run_exact_rollback():
    """A worker exits between two commits, after step 43 or after step 47 (commits every 10 steps):
    either way the survivors roll back to the commit of step 40 and go on as 2 workers, so the two
    jobs must end bitwise equal (the same final loss), unsharded and under each ZeRO stage. A
    rollback that kept any of the discarded steps (weights, slots, counts) would differ."""
    args = ["--train-limit", str(IMAGES), "--epochs", "1", "--batch-size", "96", "--json"]
    steps = IMAGES // 96
    losses = {}
    for sharding in ["none", "gradients", "parameters"]:
        for at in (43, 47):
            what = f"--sharding {sharding}, worker 1 exits after step {at}"
            discovery(["localhost:2"])  # no slot for a replacement
            proc, out, err = start(3, args=args, example_args=["--sharding", sharding, "--exit-at-step", str(at)])
            r, e = finish(proc, out, err, what)
            if r["resets"] != 1 or r["workers"] != 2 or r["optimizer_steps"] != steps or r["rolled_back_steps"] != at - 40:
                fail(f"{what}: expected 1 reset, 2 workers, {steps} steps, {at - 40} rolled back: {r}")
            losses[(sharding, at)] = r["final_loss"]
        if losses[(sharding, 43)] != losses[(sharding, 47)]:
            fail(f"--sharding {sharding}: the rollback is not exact: final loss {losses[(sharding, 43)]!r} "
                 f"(exit after step 43) vs {losses[(sharding, 47)]!r} (after step 47)")
    print("exact rollback: final losses " + ", ".join(f"{k[0]}@{k[1]}={v!r}" for k, v in losses.items()))

def run_reset_before_the_first_commit():
    """Worker 1 exits after step 5, before the first commit (step 10): the survivors restore the
    state the job started with, the rate included, so the LearningRateScheduler changes epoch 0's
    rate once on every worker (a survivor that kept its rate would change it twice)."""
    discovery(["localhost:2"])
    args = ["--train-limit", str(IMAGES), "--epochs", "1", "--batch-size", "96", "--lr-decay", str(DECAY), "--json"]
    proc, out, err = start(3, args=args, example_args=["--exit-at-step", "5"])
    r, _ = finish(proc, out, err, "a reset before the first commit")
    expected = struct.unpack("f", struct.pack("f", struct.unpack("f", struct.pack("f", LR))[0] * DECAY))[0]
    if r["resets"] != 1 or r["rolled_back_steps"] != 5 or r["learning_rate"] != expected or not r["workers_agree"]:
        fail(f"a reset before the first commit: expected 1 reset, 5 steps rolled back, rate {expected!r} on "
             f"every worker: {r}")
    print(f"reset before the first commit: rate {r['learning_rate']!r} on every worker")

def run_reset_in_the_warm_up():
    """Worker 1 exits after step 43 of a 1-epoch warm-up (commits every 10 steps hold no warming
    rate): the survivors roll back to step 40 and warm up towards the user's rate again, which is
    the rate of the second epoch (a commit that held the warming rate would make it the target)."""
    discovery(["localhost:2"])
    args = ["--train-limit", str(IMAGES), "--epochs", "2", "--batch-size", "96", "--warmup-epochs", "1", "--json"]
    proc, out, err = start(3, args=args, example_args=["--exit-at-step", "43"])
    r, _ = finish(proc, out, err, "a reset in the warm-up")
    rate = struct.unpack("f", struct.pack("f", LR))[0]
    if r["resets"] != 1 or r["learning_rate"] != rate or not r["workers_agree"]:
        fail(f"a reset in the warm-up: expected 1 reset and the rate {rate!r} on every worker after it: {r}")
    print(f"reset in the warm-up: rate {r['learning_rate']!r} on every worker after it")

def expect_failure(proc, err, what, needles, limit):
    """Waits for a job that must fail, naming why; returns its exit status."""
    try:
        proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        proc.kill(); fail(f"{what} hung")
    e = text(err)
    if proc.returncode == 0: fail(f"{what} exited 0")
    if not all(n in e for n in needles): fail(f"{what}: no reason given:\n{e[-2000:]}")
    return proc.returncode

def run_callbacks_differ():
    """EarlyStopping on rank 0 alone: its commits would hold states the other's do not, which a
    restore could not rebuild; the job must end when fit() starts, naming the callbacks. Restoring
    the best weights, fit() refuses it (it changes what the replicas hold); keeping the last ones,
    elastic::run does (its state is in the commits)."""
    args = ["--train-limit", "960", "--epochs", "1", "--batch-size", "96", "--patience", "2", "--patience-rank0-only"]
    for extra, needle in (([], "the workers run different callbacks"),
                          (["--keep-last-weights"], "callbacks keep different states")):
        discovery(["localhost:2"])
        t0 = time.time()
        proc, out, err = start(2, args=args + extra)
        rc = expect_failure(proc, err, "a job whose workers keep different callbacks' states",
                            [needle, "EarlyStopping(val_loss)"], 120)
        print(f"callbacks differ{' (last weights)' if extra else ''}: exit {rc} after {time.time() - t0:.1f} s, "
              "callbacks named")

def run_below_min_np():
    discovery(["localhost:2"])
    proc, out, err = start(2, settle="2")
    rdzv = wait_for(err, r"rendezvous at (\S+)", proc).group(1)
    wait_for(err, rf"\[worker:0\] Epoch 2/{EPOCHS}", proc)
    discovery(["localhost:1"])
    t0 = time.time()
    os.kill(pid_of(1, rdzv), signal.SIGKILL)
    rc = expect_failure(proc, err, "a job below --min-np", ["no round of at least --min-np workers formed"], 90)
    print(f"below --min-np: exit {rc} after {time.time() - t0:.1f} s, reason named")

def run_usage():
    for args, needle in [(["--min-np", "3", "--max-np", "4", "-np", "2"], "1 <= --min-np <= -np <= --max-np"),
                         (["--min-np", "1", "--max-np", "2", "-np", "2", "--ps", "1"], "takes no --ps")]:
        r = subprocess.run([dtrain_run, *args, "--", example], capture_output=True, text=True, timeout=30)
        if r.returncode != 2 or needle not in r.stderr: fail(f"{args}: exit {r.returncode}, {r.stderr}")
    r = subprocess.run([example], capture_output=True, text=True, timeout=30,
                       env={k: v for k, v in os.environ.items() if not k.startswith("DTRAIN_ELASTIC")})
    if r.returncode == 0 or "dtrain-run --min-np" not in r.stderr: fail(f"started by hand: {r.stderr}")
    print("usage errors: refused with their fixes")

def main():
    if mode == "netns":
        up = subprocess.run([netns, "up", "--prefix", prefix, "--hosts", "4", "--rate", "1gbit"],
                            capture_output=True, text=True, timeout=60)
        if up.returncode == 77:
            print("skipped:", up.stderr.strip()); return 77
        if up.returncode != 0: fail(f"dtrain-netns up:\n{up.stderr}")
    try:
        if mode == "local": run_usage()
        ref = run_reference()
        run_disturbed(ref)
        if mode == "local":
            run_disturbed(ref, "parameters")  # ZeRO-3: the state in pieces, parts cut for 3, 2, 3 workers
            run_exact_rollback()
            run_reset_before_the_first_commit()
            run_reset_in_the_warm_up()
            run_callbacks_differ()
            run_below_min_np()
    finally:
        if mode == "netns": subprocess.run([netns, "down", "--prefix", prefix], capture_output=True, timeout=60)
    print("PASSED")
    return 0

sys.exit(main())
