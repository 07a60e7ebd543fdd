#!/usr/bin/env python3
"""The timeline (Chrome trace) of a MultiWorkerMirrored job, a Mirrored process and the Horovod example.

dtrain-run --timeline-filename merges every task's events into one file; checked: it is a trace
(traceEvents, complete "X" events with begin and duration, so every begin has its end), every rank
has its process row, events on each thread nest properly in time, and each step shows the input
batch, the forward and backward passes, the gradient pack's phases (waiting for its gradients,
packing, the three all-reduce stages, unpacking) and the optimizer update. The per-task files are
removed after the merge. Also DTRAIN_TIMELINE for one process, and hvd's collectives.

  timeline_test.py DTRAIN_RUN FASHION_MNIST HOROVOD_EXAMPLE [PLOT_SCRIPT]
"""
import glob, json, os, subprocess, sys, tempfile

def load(path):
    with open(path) as f:
        j = json.load(f)
    if not isinstance(j.get("traceEvents"), list):
        sys.exit(f"{path}: no traceEvents array")
    return j["traceEvents"]

def check_nesting(events, what):
    by_thread = {}
    for e in events:
        if e.get("ph") != "X":
            continue
        if e["dur"] < 0 or not isinstance(e["ts"], int):
            sys.exit(f"{what}: bad event {e}")
        by_thread.setdefault((e["pid"], e["tid"]), []).append(e)
    for key, evs in by_thread.items():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack = []
        for e in evs:
            while stack and stack[-1][0] <= e["ts"]:
                stack.pop()
            if stack and e["ts"] + e["dur"] > stack[-1][0]:
                sys.exit(f"{what}: on thread {key} '{e['name']}' overlaps '{stack[-1][1]}' without nesting in it")
            stack.append((e["ts"] + e["dur"], e["name"]))
    return by_thread

def names_of(events, pid):
    return [e["name"] for e in events if e.get("ph") == "X" and e["pid"] == pid]

def require(names, wanted, what):
    for w in wanted:
        if not any(w in n for n in names):
            sys.exit(f"{what}: no '{w}' event; have {sorted(set(n.split(' (')[0] for n in names))[:30]}")

def run(cmd, env=None):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    if r.returncode != 0:
        sys.exit(f"failed ({r.returncode}): {' '.join(cmd)}\n{r.stdout}\n{r.stderr}")
    return r.stdout + r.stderr

def main():
    dtrain_run, fashion, horovod = sys.argv[1:4]
    plot = sys.argv[4] if len(sys.argv) > 4 else None
    steps = 10
    short = [f"--steps={steps}", "--no-eval", "--batch-size=64", "--train-limit=2000"]
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "mwms.json")
        out = run([dtrain_run, "-np", "2", "--timeline-filename", path, "--", fashion, "--strategy=multi_worker_mirrored",
                   "--devices=cpu:2"] + short)
        if "timeline of 2 task(s)" not in out or glob.glob(path + ".*.json"):
            sys.exit(f"dtrain-run did not merge and remove the per-task files:\n{out}")
        ev = load(path)
        rows = {e["pid"]: e["args"]["name"] for e in ev if e.get("name") == "process_name"}
        if sorted(rows.values()) != ["worker:0", "worker:1"]:
            sys.exit(f"process rows {rows}, expected worker:0 and worker:1")
        check_nesting(ev, "MWMS")
        for pid in rows:
            names = names_of(ev, pid)
            require(names, ["input batch", "forward", "backward", "optimizer update", "wait for its gradients", "pack",
                            "all-reduce stage 1", "all-reduce stage 2", "all-reduce stage 3", "unpack"], rows[pid])
            n = sum(1 for x in names if x.startswith("step "))
            if n != steps:
                sys.exit(f"{rows[pid]}: {n} step events, expected {steps}")
            threads = {e["args"]["name"] for e in ev if e.get("name") == "thread_name" and e["pid"] == pid}
            for t in ("training loop", "CPU:0 device", "CPU:1 device"):
                if t not in threads:
                    sys.exit(f"{rows[pid]}: no thread row '{t}' in {threads}")
        print(f"ok: MWMS 2 workers x 2 replicas: {len(ev)} events, every rank and phase present, properly nested")
        # Gradient accumulation: one all-reduce per k batches (Horovod's backward_passes_per_step).
        per_step = {pid: sum(1 for x in names_of(ev, pid) if x.startswith("all-reduce stage 2")) / steps for pid in rows}
        acc = os.path.join(d, "accumulate.json")
        run([dtrain_run, "-np", "2", "--timeline-filename", acc, "--", fashion, "--strategy=multi_worker_mirrored",
             "--devices=cpu:2", "--accumulate=5"] + short)
        ev_acc = load(acc)
        for pid, name in rows.items():
            got = sum(1 for x in names_of(ev_acc, pid) if x.startswith("all-reduce stage 2"))
            if per_step[pid] < 1 or got != per_step[pid] * steps / 5:
                sys.exit(f"{name}: --accumulate=5 ran {got} cross-worker all-reduces in {steps} steps; expected "
                         f"{per_step[pid] * steps / 5:g} ({per_step[pid]:g} per update)")
        print(f"ok: --accumulate=5: {steps // 5} all-reduces in {steps} steps on every worker")
        if plot:
            png = os.path.join(d, "t.png")
            r = subprocess.run(["/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable,
                                plot, path, "--out", png], capture_output=True, text=True, timeout=120)
            if r.returncode == 0:
                print(f"ok: Gantt PNG {os.path.getsize(png)} bytes")
            elif "needs matplotlib" in r.stdout + r.stderr:
                print("skipped: the Gantt PNG (no matplotlib)")
            else:
                sys.exit(f"plot_timeline.py failed:\n{r.stdout}{r.stderr}")

        one = os.path.join(d, "mirrored.json")
        run([fashion, "--strategy=mirrored", "--devices=cpu:2"] + short, env=dict(os.environ, DTRAIN_TIMELINE=one))
        ev = load(one)
        check_nesting(ev, "mirrored")
        # Logical CPU devices share their variables: the gradients are reduce-scattered, each replica
        # updates its slices, and a barrier ends the update.
        require(names_of(ev, ev[0]["pid"]), ["forward", "backward", "reduce-scatter", "optimizer update",
                                            "barrier: every slice updated"], "mirrored")
        print(f"ok: Mirrored cpu:2 with DTRAIN_TIMELINE: {len(ev)} events, properly nested")

        hp = os.path.join(d, "hvd.json")
        run([dtrain_run, "-np", "2", "--timeline-filename", hp, "--", horovod, "--epochs=1", "--train-limit=640"])
        ev = load(hp)
        check_nesting(ev, "hvd")
        for pid in {e["pid"] for e in ev}:
            require(names_of(ev, pid), ["hvd negotiate", "hvd allreduce 'DistributedOptimizer", "forward", "backward"],
                    f"hvd rank {pid}")
        print("ok: the Horovod example: hvd negotiations and all-reduces on every rank")

if __name__ == "__main__":
    main()
