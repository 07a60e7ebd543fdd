#!/usr/bin/env python3
"""Scaling where links matter: ResNet-50 (Horovod's synthetic benchmark) and GPT-2 small trained by H
workers on H network-namespace test hosts (tools/netns/dtrain-netns: one address and one shaped link
each, through one switch), dtrain's MultiWorkerMirrored against PyTorch DDP over gloo on the same hosts
and links, in interleaved rounds; medians of seconds per step.

  bench/links/links.py [--build build] [--models resnet50,gpt2] [--hosts 2,4] [--rates none,10gbit,1gbit]
      [--systems dtrain,ddp] [--rounds 2] [--warmup 1] [--steps 2] [--resnet-batch 32] [--gpt-batch 4]
      [--context 256] [--out DIR] [--profile] [--profile-each-run] [--simulate] [--from links.jsonl] [--json]

Per run: seconds per step (the workers' slowest), images or tokens per second of the job, peak RSS of the
largest worker, and for dtrain, from its timeline (DTRAIN_TIMELINE, merged by dtrain-run): the
all-reduce time per step and the share of it that ran while backward was still running (hidden).
Each worker is pinned to a core (dtrain-run --bind-to core; taskset for the peers): with more hosts than
cores, workers share cores, and the steps are then longer for both systems alike.

--profile: also records, for the simulator (`dtrain-bench simulate`), each model's compute profile in
every round, just before that round's runs: one worker's timeline with no peer (forward, backward with
the moment and size of every gradient, the update) while H such one-worker jobs run at once, placed on
the cores as the H-host runs place their workers (so what co-located workers cost each other, the core,
caches and memory bandwidth, is in it); and the links' own all-reduce speed on each (H, rate)
(dtrain-bench allreduce over the same hosts), with the compute it takes from the work beside it per
byte a rank moves, at that rate (a compute probe beside each rank). The profile jobs run one warm-up
step more than the runs (PROFILE_EXTRA_WARMUP). --simulate: then predicts every dtrain run from its own
round's profiles, one a worker, and takes the slowest worker's step (a synchronous step waits for its slowest worker, and on a
shared VM one core can run slower than the other for minutes); prints the median prediction against the
median measured step, and what worker 0's profile alone predicts. --profile-each-run: the profiles are
recorded just before each dtrain run instead of once a round, so that a prediction and its run see the
machine at the same speed (a shared VM's speed can move by 30% between the start and the end of a round);
a round then takes about 1.5x as long. --from FILE: no training, the rows of
an earlier links.jsonl (and the profiles beside it), the links measured again; with --stored-links, not
measured again: each row's own link figures, as its run measured them (a change of the step model
checked against earlier runs, nothing but the model changing).

Needs root (network namespaces); the peers' interpreter is build/peers-venv/bin/python
(bench/peers/setup.sh). Files go to --out (default build/links): links.jsonl (one object per run),
timelines, profiles.
"""
import argparse, json, os, re, statistics, subprocess, sys, time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
PREFIX = "lk"


def sh(cmd, timeout=3600, check=True):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({r.returncode}):\n{(r.stdout + r.stderr)[-3000:]}")
    return r


def netns(*args, check=True):
    r = sh(["bash", os.path.join(ROOT, "tools", "netns", "dtrain-netns"), *args, "--prefix", PREFIX], check=False)
    if check and r.returncode == 77:  # no network namespaces here: a test that runs this skips
        print(f"links.py: {r.stderr.strip()}", file=sys.stderr)
        sys.exit(77)
    if check and r.returncode != 0:
        raise SystemExit(f"dtrain-netns {' '.join(args)} failed ({r.returncode}):\n{(r.stdout + r.stderr)[-3000:]}")
    return r


def json_lines(text):
    out = []
    for line in text.splitlines():
        line = line.split("] ", 1)[-1] if line.startswith("[") else line
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return out


# The profile jobs run one warm-up step more than the runs they predict. With H jobs started together on
# the cores, the first step after the warm-up one was still slow in them (Zen 5, 4 hosts, 2026-11-29:
# ResNet-50's forward 2.4-2.5 s in that step against 1.3-1.5 in the next, in all four jobs of a round)
# while the runs' were not; with that step in, the round predicted its unshaped runs 15-21% high, with
# it left out (links --from) -1% to +9%, and the two rounds' predictions of each row agree within 3.5%.
PROFILE_EXTRA_WARMUP = 1


def dtrain_command(a, model, hosts, warmup=None):
    warmup = a.warmup if warmup is None else warmup
    if model == "resnet50":
        return [os.path.join(a.build, "examples", "synthetic_benchmark"), "--model", "resnet50",
                "--batch-size", str(a.resnet_batch), "--num-warmup-batches", str(warmup),
                "--num-batches-per-iter", "1", "--num-iters", str(a.steps), "--threads", "1", "--json",
                "--resnet-style", a.resnet_style]
    n = warmup + a.steps
    return [os.path.join(a.build, "examples", "gpt"), "--preset", "gpt2", "--context", str(a.context),
            "--batch-size", str(hosts * a.gpt_batch), "--steps", str(n), "--steps-per-epoch", str(n),
            "--epochs", "1", "--val-windows", "1", "--timing-warmup-steps", str(warmup), "--threads", "1",
            "--json"]


def seconds_per_step(a, model, row):
    if model == "resnet50":
        return a.resnet_batch / row["img_sec_per_device"]
    return row["seconds_per_step"]


def run_dtrain(a, model, hosts, tag):
    timeline = os.path.join(a.out, f"timeline_{tag}.json")
    cmd = [os.path.join(a.build, "tools", "dtrain-run"), "--netns", PREFIX, "-np", str(hosts), "--timeout",
           "1800", "--timeline-filename", timeline, "--"] + dtrain_command(a, model, hosts) + \
        ["--strategy=multi_worker_mirrored"]
    r = sh(cmd, timeout=2000)
    rows = [j for j in json_lines(r.stdout) if "peak_rss_mb" in j]
    if not rows:
        raise SystemExit(f"no result from {' '.join(cmd)}:\n{r.stdout[-2000:]}")
    row = rows[-1]
    out = {"seconds_per_step": seconds_per_step(a, model, row), "peak_rss_mb": row["peak_rss_mb"]}
    out.update(overlap(timeline, a.warmup))
    return out


def run_ddp(a, model, hosts, python):
    port = 29500 + int(time.time()) % 400
    master = netns("list").stdout.split()[1]  # host 0's address ("namespace address" lines)
    cores = sorted(os.sched_getaffinity(0))
    procs = []
    for i in range(hosts):
        if model == "resnet50":
            peer = [python, os.path.join(ROOT, "bench", "resnet", "peer_synthetic.py"), "torch", "--batch-size",
                    str(a.resnet_batch), "--num-warmup-batches", str(a.warmup), "--num-batches-per-iter", "1",
                    "--num-iters", str(a.steps)]
        else:
            peer = [python, os.path.join(ROOT, "bench", "gpt", "peer_gpt.py"), "--context", str(a.context),
                    "--batch-size", str(a.gpt_batch), "--warmup", str(a.warmup), "--steps", str(a.steps)]
        peer += ["--threads", "1", "--workers", str(hosts), "--worker-index", str(i), "--port", str(port),
                 "--master-addr", master, "--json"]
        cmd = ["ip", "netns", "exec", f"{PREFIX}-h{i}", "taskset", "-c", str(cores[i % len(cores)]),
               "env", "OMP_NUM_THREADS=1", "GLOO_SOCKET_IFNAME=eth0"] + peer  # not the hostname's 127.0.0.1
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    secs, rss, failed = [], [], []
    # A worker that fails leaves the others waiting for it in gloo: stop them all then.
    deadline = time.time() + 2000
    while any(q.poll() is None for q in procs):
        if any(q.poll() not in (None, 0) for q in procs) or time.time() > deadline:
            for q in procs:
                if q.poll() is None:
                    q.kill()
            break
        time.sleep(0.5)
    for i, p in enumerate(procs):
        out, err = p.communicate()
        rows = json_lines(out)
        if p.returncode != 0 or not rows:
            failed.append(f"DDP worker {i} exited {p.returncode}:\n{err[-1500:]}")
            continue
        row = rows[-1]
        secs.append(a.resnet_batch / row["images_per_sec"] if model == "resnet50" else row["seconds_per_step"])
        rss.append(row["peak_rss_mb"])
    if failed:
        raise SystemExit("\n".join(failed))
    return {"seconds_per_step": max(secs), "peak_rss_mb": max(rss)}


def overlap(path, warmup):
    """From a merged dtrain timeline: all-reduce seconds per step and the share of them inside backward."""
    with open(path) as f:
        d = json.load(f)
    events = d["traceEvents"] if isinstance(d, dict) else d
    by_pid = {}
    for e in events:
        if e.get("ph") == "X":
            by_pid.setdefault(e["pid"], []).append(e)
    total = hidden = 0.0
    steps = 0
    for evs in by_pid.values():
        back = sorted((e for e in evs if e["name"] == "backward"), key=lambda e: e["ts"])
        fwd = sorted(e["ts"] for e in evs if e["name"] == "forward")
        ar = [e for e in evs if re.fullmatch(r"all-reduce \d+ KiB", e["name"])]
        for k, b in enumerate(back):
            if k < warmup:
                continue
            b0, b1 = b["ts"], b["ts"] + b["dur"]
            nxt = next((t for t in fwd if t > b1), float("inf"))
            for e in ar:
                if b0 <= e["ts"] < nxt:
                    total += e["dur"]
                    hidden += max(0, min(e["ts"] + e["dur"], b1) - max(e["ts"], b0))
            steps += 1
    if not steps:
        return {}
    return {"allreduce_seconds_per_step": total / steps / 1e6, "hidden_share": hidden / total if total else 0.0}


def profile_name(model, batch, hosts, rnd, rate=""):
    return f"profile_{model}_b{batch}_h{hosts}_r{rnd}{'_' + rate if rate else ''}.json"


def legacy_profile_name(model, batch, per_core):
    """Runs before 2026-11-28 (evening) kept one profile a (model, hosts): `per_core` jobs on core 0 alone."""
    return f"profile_{model}_b{batch}_k{per_core}.json"


def profile_runs(a, model, hosts, path):
    """`hosts` one-worker jobs at once, job i on core i % cores, as dtrain-run --bind-to core (and the DDP
    runs) place worker i; returns every job's timeline (job 0's at `path`, job j's at `path`.j): the
    profile of the worker on that core."""
    cores = sorted(os.sched_getaffinity(0))
    procs = []
    for j in range(hosts):
        env = dict(os.environ, DTRAIN_TIMELINE=path if j == 0 else f"{path}.{j}")
        cmd = ["taskset", "-c", str(cores[j % len(cores)])] + \
            dtrain_command(a, model, 1, a.warmup + PROFILE_EXTRA_WARMUP) + \
            ["--strategy=mirrored", "--devices=cpu"]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    failed = []
    for p in procs:
        out, err = p.communicate(timeout=2000)
        if p.returncode != 0:
            failed.append(f"profile run failed ({p.returncode}):\n{err[-2000:]}")
    if failed:
        raise SystemExit("\n".join(failed))
    return [path] + [f"{path}.{j}" for j in range(1, hosts)]


def allreduce_command(a, hosts):
    return [os.path.join(a.build, "tools", "dtrain-bench"), "allreduce", "--backend", "tcp", "--ranks", str(hosts),
            "--netns", PREFIX, "--warmup", "1", "--json"]


def link_speed(a, hosts):
    """dtrain's TCP all-reduce over these hosts: bus bandwidth (bytes/s) at 64 MiB, seconds at 4 KiB."""
    r = sh(allreduce_command(a, hosts) + ["--sizes", "4K,64M", "--iters", "3"], timeout=900)
    rows = [j for j in json_lines(r.stdout) if j.get("backend") == "tcp"]
    big = max(rows, key=lambda j: j["bytes"])
    small = min(rows, key=lambda j: j["bytes"])
    return {"busbw_bytes_per_sec": big["busbw_GBps"] * 1e9, "small_seconds": small["time_us"] / 1e6}


def compute_lost_per_byte(a, hosts, busbw):
    """What the all-reduce takes from the compute beside it, at the links as they are now: the core seconds
    lost per byte a rank moves (dtrain-bench allreduce --compute-probe: the ranks pinned as dtrain-run
    --bind-to core places the workers, a compute thread beside each, 64 MiB all-reduces for about 3 s at
    the links' idle speed, 5-6 s beside the probes, against the probes' rate just before). That counts
    the ranks' own CPU, the kernel's work on the link (on a shaped veth link most of it is softirq and
    qdisc timers, which the ranks' CPU time does not show) and what they evict from the caches; the
    ranks' CPU per byte is returned beside it. On 2-core Zen 5, 2 hosts: 0.50-0.59 ns lost unshaped
    (ranks' CPU 0.45-0.52), 0.83-1.02 at 1 Gbit/s (ranks' 0.24-0.27). The probe's product stays in L2:
    it does not feel the memory bandwidth the all-reduce takes (a streaming probe lost 10-45% more)."""
    moved_per_rank = 2 * (hosts - 1) / hosts * 64 * 2**20
    iters = max(3, min(60, -(-3 * busbw // moved_per_rank)))
    r = sh(allreduce_command(a, hosts) + ["--sizes", "64M", "--iters", str(int(iters)), "--compute-probe"], timeout=900)
    row = [j for j in json_lines(r.stdout) if j.get("backend") == "tcp"][-1]
    return max(0.0, row["compute_lost_ns_per_byte"] * 1e-9), row["cpu_us"] * 1e-6 / (hosts * moved_per_rank)


def measure_links(a, hosts, rates):
    """link_speed at each rate, and compute_lost_per_byte there: {rate: {...}}. The step model charges
    backward cpu_seconds_per_byte for the bytes moved while it runs: the compute lost (since 2026-11-29,
    session 43; before, the ranks' CPU on unshaped links at every rate, which misses a shaped link's kernel
    work: rows of earlier runs keep theirs; cpu_charge, in the rows since, records which they carry)."""
    out = {}
    for rate in rates:
        for h in range(hosts):
            netns("link", str(h), "--rate", rate)
        speed = link_speed(a, hosts)
        lost, ranks_cpu = compute_lost_per_byte(a, hosts, speed["busbw_bytes_per_sec"])
        out[rate] = dict(speed, cpu_seconds_per_byte=lost, ranks_cpu_seconds_per_byte=ranks_cpu,
                         cpu_charge="compute lost beside the all-reduce at this rate")
        print(f"links: {hosts} hosts at {rate}: all-reduce bus bandwidth "
              f"{out[rate]['busbw_bytes_per_sec'] / 1e6:.1f} MB/s at 64 MiB, {out[rate]['small_seconds'] * 1e3:.2f} "
              f"ms at 4 KiB; {lost * 1e9:.2f} ns of compute lost per byte moved (the ranks' CPU "
              f"{ranks_cpu * 1e9:.2f})", flush=True)
    return out


def worker_profiles(row):
    """The profiles of a run's workers (one a core's job, recorded together); runs before 2026-11-28
    (late night) kept worker 0's alone."""
    return row.get("profiles") or [row["profile"]]


def simulate(a, profile, hosts, link, ncores, warmup):
    cmd = [os.path.join(a.build, "tools", "dtrain-bench"), "simulate", "--profile", profile, "--warmup",
           str(warmup), "--workers", str(hosts), "--busbw", str(link["busbw_bytes_per_sec"]),
           "--small-allreduce-seconds", str(link["small_seconds"]), "--comm-cpu-ns-per-byte",
           str(1e9 * link.get("cpu_seconds_per_byte", 0)), "--workers-per-core", str(-(-hosts // ncores)),
           "--json"]
    rows = [j for j in json_lines(sh(cmd).stdout) if "seconds_per_step" in j]
    return rows[-1]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--build", default="build")
    p.add_argument("--models", default="resnet50,gpt2")
    p.add_argument("--hosts", default="2,4")
    p.add_argument("--rates", default="none,10gbit,1gbit")
    p.add_argument("--systems", default="dtrain,ddp")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--resnet-batch", type=int, default=32)
    p.add_argument("--resnet-style", default="torchvision", choices=["torchvision", "keras"],
                   help="dtrain's ResNet-50: torchvision's form, the model DDP trains (default since "
                   "2026-11-28), or Keras' (the form of the tables before)")
    p.add_argument("--gpt-batch", type=int, default=4)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--out", default="")
    p.add_argument("--peers-python", default="")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--profile-each-run", action="store_true",
                   help="with --profile: record the profiles just before each dtrain run, not once a round")
    p.add_argument("--simulate", action="store_true")
    p.add_argument("--json", action="store_true")
    p.add_argument("--from", dest="from_file", default="",
                   help="no training runs: the rows of an earlier links.jsonl (with their profiles); with "
                        "--simulate the links are measured again and every dtrain row predicted")
    p.add_argument("--stored-links", action="store_true",
                   help="with --from --simulate: each row's link figures as its run measured them, not "
                        "measured again (no namespaces needed)")
    a = p.parse_args()
    a.build = os.path.abspath(a.build)
    a.out = os.path.abspath(a.out or os.path.join(a.build, "links"))
    os.makedirs(a.out, exist_ok=True)
    python = a.peers_python or os.path.join(a.build, "peers-venv", "bin", "python")
    models, hosts_list = a.models.split(","), [int(h) for h in a.hosts.split(",")]
    rates, systems = a.rates.split(","), a.systems.split(",")
    for m in models:
        if m not in ("resnet50", "gpt2"):
            raise SystemExit(f"--models: resnet50 or gpt2, got '{m}'")
    for s in systems:
        if s not in ("dtrain", "ddp"):
            raise SystemExit(f"--systems: dtrain or ddp, got '{s}'")
    if "ddp" in systems and not a.from_file and not os.access(python, os.X_OK):  # --from trains nothing
        raise SystemExit(f"no peers interpreter at {python}: run bench/peers/setup.sh, or give --peers-python")
    if a.stored_links and not (a.from_file and a.simulate):
        raise SystemExit("--stored-links goes with --from FILE --simulate (it says which link figures predict "
                         "the stored runs)")
    if a.stored_links:
        return from_file(a, "?", len(os.sched_getaffinity(0)))
    if os.geteuid() != 0:
        print("links.py needs root: it makes network namespaces (tools/netns/dtrain-netns)", file=sys.stderr)
        sys.exit(77)
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    ncores = len(os.sched_getaffinity(0))
    if a.profile_each_run and not a.profile:
        raise SystemExit("--profile-each-run goes with --profile (it says when the profiles are recorded)")
    if a.from_file:
        return from_file(a, cpu, ncores)
    log = open(os.path.join(a.out, "links.jsonl"), "a")
    results = []
    netns("down", check=False)
    try:
        for hosts in hosts_list:
            netns("up", "--hosts", str(hosts), "--rate", "none")
            links = measure_links(a, hosts, rates) if a.profile else {}
            for rnd in range(a.rounds):
                profiles = {}

                def record_profile(model, rate=""):
                    batch = a.resnet_batch if model == "resnet50" else a.gpt_batch
                    t0 = time.time()
                    profiles[model] = profile_runs(
                        a, model, hosts, os.path.join(a.out, profile_name(model, batch, hosts, rnd + 1, rate)))
                    print(f"round {rnd + 1}: {model} profile{' before the ' + rate + ' run' if rate else ''}, "
                          f"{hosts} one-worker jobs at once ({time.time() - t0:.0f} s)", flush=True)

                if a.profile and not a.profile_each_run and "dtrain" in systems:
                    for model in models:
                        record_profile(model)
                for rate in rates:
                    for h in range(hosts):
                        netns("link", str(h), "--rate", rate)
                    for model in models:
                        for system in systems:
                            if a.profile_each_run and system == "dtrain":
                                record_profile(model, rate)
                            tag = f"{model}_h{hosts}_{rate}_r{rnd + 1}"
                            t0 = time.time()
                            res = run_dtrain(a, model, hosts, tag) if system == "dtrain" else \
                                run_ddp(a, model, hosts, python)
                            res.update({"benchmark": "links", "model": model, "hosts": hosts, "rate": rate,
                                        "system": system, "round": rnd + 1, "cpu": cpu, "cores": ncores,
                                        "warmup": a.warmup, "steps": a.steps,
                                        "batch_per_worker": a.resnet_batch if model == "resnet50" else a.gpt_batch})
                            if model == "gpt2":
                                res["context"] = a.context
                            if a.profile and rate in links:
                                res.update({"link_" + k: v for k, v in links[rate].items()})
                            if system == "dtrain" and model in profiles:
                                res["profile"], res["profiles"] = profiles[model][0], profiles[model]
                                res["profile_each_run"] = a.profile_each_run
                                res["profile_warmup"] = a.warmup + PROFILE_EXTRA_WARMUP
                            results.append(res)
                            log.write(json.dumps(res) + "\n")
                            log.flush()
                            extra = f", all-reduce {res['allreduce_seconds_per_step']:.2f} s/step, " \
                                    f"{100 * res['hidden_share']:.0f}% hidden" if "hidden_share" in res else ""
                            print(f"round {rnd + 1}: {model} {hosts} hosts {rate} {system}: "
                                  f"{res['seconds_per_step']:.2f} s/step{extra} ({time.time() - t0:.0f} s)",
                                  flush=True)
            netns("down")
    finally:
        netns("down", check=False)
    report(a, results, cpu, ncores)


def from_file(a, cpu, ncores):
    """--from: the rows of an earlier run; with --simulate, each (hosts, rate) link measured again."""
    results = [json.loads(l) for l in open(a.from_file) if l.startswith("{")]
    if not results:
        raise SystemExit(f"{a.from_file}: no rows (a links.jsonl written by this script)")
    r0 = results[0]
    a.rounds = max(r["round"] for r in results)
    a.warmup, a.steps = r0["warmup"], r0["steps"]
    for r in results:
        if r["model"] == "resnet50":
            a.resnet_batch = r["batch_per_worker"]
        else:
            a.gpt_batch, a.context = r["batch_per_worker"], r.get("context", a.context)
    a.profile_each_run = any(r.get("profile_each_run") for r in results)
    here = os.path.dirname(os.path.abspath(a.from_file))
    for r in results:
        if r["system"] == "dtrain" and "profile" not in r:
            r["profile"] = os.path.join(here, legacy_profile_name(r["model"], r["batch_per_worker"],
                                                                  max(1, -(-r["hosts"] // ncores))))
    if a.simulate and not a.stored_links:
        netns("down", check=False)
        try:
            for hosts in sorted({r["hosts"] for r in results}):
                netns("up", "--hosts", str(hosts), "--rate", "none")
                links = measure_links(a, hosts, list(dict.fromkeys(r["rate"] for r in results if r["hosts"] == hosts)))
                for r in results:
                    if r["hosts"] == hosts:
                        r.update({"link_" + k: v for k, v in links[r["rate"]].items()})
                netns("down")
        finally:
            netns("down", check=False)
    report(a, results, r0.get("cpu", cpu), r0.get("cores", ncores))


def report(a, results, cpu, ncores):
    print(f"\nCPU: {cpu} ({ncores} cores); medians of {a.rounds} interleaved round(s), {a.steps} timed step(s) "
          f"after {a.warmup}; ResNet-50 batch {a.resnet_batch}, GPT-2 small {a.gpt_batch} x {a.context} tokens "
          f"per worker; one thread per worker")
    print(f"{'model':<9} {'hosts':>5} {'link':>7} {'system':>7} {'s/step':>8} {'vs none':>8} {'dtrain vs DDP':>14} "
          f"{'all-reduce s':>13} {'hidden':>7} {'RSS MB':>8}")
    keys = sorted({(r["model"], r["hosts"], r["rate"], r["system"]) for r in results},
                  key=lambda k: (k[0], k[1], ["none", "10gbit", "1gbit"].index(k[2]) if k[2] in
                                 ["none", "10gbit", "1gbit"] else 9, k[3]))
    med = {}
    for k in keys:
        rows = [r for r in results if (r["model"], r["hosts"], r["rate"], r["system"]) == k]
        med[k] = {f: statistics.median(r[f] for r in rows) for f in rows[0]
                  if isinstance(rows[0][f], float)}
        med[k]["rows"] = rows
    for k in keys:
        m = med[k]
        base = med.get((k[0], k[1], "none", k[3]))
        vs = f"{m['seconds_per_step'] / base['seconds_per_step']:.3f}x" if base else "-"
        other = med.get((k[0], k[1], k[2], "ddp"))
        vd = f"{other['seconds_per_step'] / m['seconds_per_step']:.2f}x" if other and k[3] == "dtrain" else ""
        ar = f"{m['allreduce_seconds_per_step']:.2f}" if "allreduce_seconds_per_step" in m else ""
        hid = f"{100 * m['hidden_share']:.0f}%" if "hidden_share" in m else ""
        print(f"{k[0]:<9} {k[1]:>5} {k[2]:>7} {k[3]:>7} {m['seconds_per_step']:>8.2f} {vs:>8} {vd:>14} {ar:>13} "
              f"{hid:>7} {m['peak_rss_mb']:>8.0f}")
        if a.json:
            print(json.dumps({"model": k[0], "hosts": k[1], "rate": k[2], "system": k[3],
                              **{f: v for f, v in m.items() if f != "rows"}}))
    print("vs none: the step against the same system's step on unlimited links (--rate none); dtrain vs DDP: "
          "DDP's step time over dtrain's; all-reduce s: per step, summed over gradient packs; hidden: the share "
          "of it that ran while backward was running (dtrain's timeline)")
    if a.simulate:
        when = "the profiles recorded just before it" if a.profile_each_run else "its round's profiles"
        print(f"\nsimulated (dtrain-bench simulate: each run predicted from {when}, the slowest "
              f"worker's step, + the links' measured all-reduce speed; medians) against measured, dtrain:")
        for k in keys:
            if k[3] != "dtrain":
                continue
            rows = [r for r in med[k]["rows"] if "profile" in r and "link_busbw_bytes_per_sec" in r]
            missing = sorted({p for r in rows for p in worker_profiles(r) if not os.path.exists(p)})
            if missing:
                print(f"  {k[0]:<9} {k[1]} hosts {k[2]:>7}: not predicted, no profile at {', '.join(missing)} "
                      f"(run with --profile; --from reads the profiles beside links.jsonl)")
                continue
            if not rows:
                continue
            preds, firsts = [], []
            for row in rows:
                link = {k2[5:]: v for k2, v in row.items() if k2.startswith("link_")}
                # Runs before 2026-11-29 (session 43) profiled with the runs' own warm-up.
                warm = row.get("profile_warmup", row.get("warmup", a.warmup))
                each = [simulate(a, p, k[1], link, ncores, warm)["seconds_per_step"] for p in worker_profiles(row)]
                preds.append(max(each))
                firsts.append(each[0])
            pred = statistics.median(preds)
            meas = statistics.median(r["seconds_per_step"] for r in rows)
            err = pred / meas - 1
            per_round = ", ".join(f"{p:.2f} vs {r['seconds_per_step']:.2f}" for p, r in zip(preds, rows))
            first = statistics.median(firsts)
            print(f"  {k[0]:<9} {k[1]} hosts {k[2]:>7}: predicted {pred:.2f} s/step, measured {meas:.2f} "
                  f"({100 * err:+.1f}%; from worker 0's profile alone {first:.2f}, {100 * (first / meas - 1):+.1f}%)"
                  + (f"  [rounds: {per_round}]" if len(rows) > 1 else ""))
            if a.json:
                print(json.dumps({"benchmark": "links_simulated", "model": k[0], "hosts": k[1], "rate": k[2],
                                  "predicted": pred, "measured": meas, "error": err,
                                  "predicted_worker0": first, "error_worker0": first / meas - 1,
                                  "rounds": [[p, r["seconds_per_step"]] for p, r in zip(preds, rows)]}))


if __name__ == "__main__":
    main()
