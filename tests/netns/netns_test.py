#!/usr/bin/env python3
"""Test hosts in network namespaces (tools/netns/dtrain-netns) and dtrain-run --netns.

Makes 3 hosts with 200 Mbit/s links, checks the shaping (a TCP stream between two hosts runs at
80-105% of the link rate), that a cut link stops traffic and a restored one carries it again, runs a
MultiWorkerMirrored job of 3 workers and a ParameterServer job (2 workers + 1 ps) across the hosts with
`dtrain-run --netns` (each task on its own host and address), checks that ranks waiting on the slow link
leave the CPU alone (dtrain-bench allreduce) and that a compute probe beside them sees what they cost it
(allreduce --compute-probe), and removes everything. Exits 77 (CTest:
skipped) with the reason where namespaces cannot be created (not root, no CAP_NET_ADMIN).

  netns_test.py DTRAIN_NETNS DTRAIN_RUN FASHION_MNIST DTRAIN_BENCH
"""
import json, os, resource, subprocess, sys, time

netns, dtrain_run, example, bench = sys.argv[1:5]
prefix = f"dt{os.getpid() % 10000}"

def sh(*cmd, timeout=120, check=True):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise SystemExit(f"failed ({r.returncode}): {' '.join(cmd)}\n{r.stdout}\n{r.stderr}")
    return r

THROUGHPUT = r'''
import socket, sys, time
mode, host, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
if mode == "server":
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((host, port)); s.listen(1)
    s.settimeout(20); c, _ = s.accept(); c.settimeout(20); n = 0; t0 = None
    while True:
        b = c.recv(1 << 20)
        if not b: break
        t0 = t0 or time.time(); n += len(b)
    print(8 * n / (time.time() - t0) / 1e6)
else:
    c = socket.create_connection((host, port), timeout=5); buf = b"x" * (1 << 20)
    for _ in range(30): c.sendall(buf)
    c.close()
'''

def mbits(port):
    server = subprocess.Popen([netns, "exec", "--prefix", prefix, "1", "--", sys.executable, "-c", THROUGHPUT,
                               "server", "192.0.2.11", str(port)], stdout=subprocess.PIPE, text=True)
    time.sleep(0.5)
    sh(netns, "exec", "--prefix", prefix, "0", "--", sys.executable, "-c", THROUGHPUT, "client", "192.0.2.11", str(port))
    out, _ = server.communicate(timeout=30)
    return float(out.strip())

def job_json(args, expect_tasks):
    r = sh(dtrain_run, "--netns", prefix, "--timeout", "120", *args, timeout=180)
    lines = [l.split("] ", 1)[-1] for l in r.stdout.splitlines() if "] {" in l]
    return [json.loads(l) for l in lines], r

def main():
    up = subprocess.run([netns, "up", "--prefix", prefix, "--hosts", "3", "--rate", "200mbit"],
                        capture_output=True, text=True, timeout=60)
    if up.returncode == 77:
        print("skipped:", up.stderr.strip())
        return 77
    if up.returncode != 0:
        raise SystemExit(f"dtrain-netns up failed:\n{up.stdout}\n{up.stderr}")
    try:
        hosts = sh(netns, "list", "--prefix", prefix).stdout.split()
        assert hosts == [f"{prefix}-h0", "192.0.2.10", f"{prefix}-h1", "192.0.2.11", f"{prefix}-h2", "192.0.2.12"], hosts
        rate = mbits(5001)
        print(f"ok: a TCP stream between two hosts: {rate:.0f} Mbit/s on a 200 Mbit/s link")
        assert 160 <= rate <= 210, rate
        sh(netns, "link", "--prefix", prefix, "1", "--down")
        cut = subprocess.run([netns, "exec", "--prefix", prefix, "0", "--", sys.executable, "-c",
                              "import socket; socket.create_connection(('192.0.2.11', 5002), timeout=2)"],
                             capture_output=True, text=True, timeout=30)
        assert cut.returncode != 0 and "timed out" in cut.stderr, cut.stderr
        sh(netns, "link", "--prefix", prefix, "1", "--up")
        print(f"ok: a cut link carries nothing; restored, {mbits(5003):.0f} Mbit/s")

        # Each task runs in its host's namespace and listens on that host's address.
        where = sh(dtrain_run, "--netns", prefix, "-np", "3", "--", "sh", "-c",
                   'echo "$DTRAIN_TASK $(ip -4 -o addr show eth0 | awk \'{print $4}\')"').stdout
        for i in range(3):
            assert f"worker:{i} 192.0.2.1{i}/24" in where, where
        print("ok: dtrain-run --netns puts task i on host i")
        # --max-restarts keeps the test hosts' addresses on the relaunch (it gave every task
        # 127.0.0.1 and a port free in the launcher's namespace instead).
        marker = f"/tmp/{prefix}-relaunch"
        if os.path.exists(marker): os.remove(marker)
        r = sh(dtrain_run, "--netns", prefix, "-np", "2", "--max-restarts", "1", "--", "sh", "-c",
               'echo "$DTRAIN_TASK $(ip -4 -o addr show eth0 | awk \'{print $4}\') $TF_CONFIG"; '
               f'[ -e {marker} ] || {{ touch {marker}; exit 3; }}')
        os.remove(marker)
        runs = [l for l in r.stdout.splitlines() if "TF_CONFIG" not in l and '"cluster"' in l]
        assert len(runs) >= 3 and "relaunching all of it" in r.stderr, r.stdout + r.stderr
        for line in runs[-2:]:  # the relaunch's two tasks (a task of the first may be stopped unheard)
            task, addr, config = line.split("] ", 1)[-1].split(" ", 2)
            cluster = json.loads(config)["cluster"]["worker"]
            assert all(a.startswith("192.0.2.1") for a in cluster), line
            i = int(task.split(":")[1])
            assert addr == f"192.0.2.1{i}/24" and cluster[i].startswith(f"192.0.2.1{i}:"), line
        print("ok: dtrain-run --netns --max-restarts relaunches on the test hosts' addresses")

        quick = ["--no-eval", "--steps=20", "--train-limit=4096", "--batch-size=96", "--json"]
        rows, r = job_json(["-np", "3", "--", example, "--strategy=multi_worker_mirrored"] + quick, 3)
        assert rows and rows[-1]["replicas"] == 3 and rows[-1]["steps"] == 20, r.stdout + r.stderr
        print(f"ok: MultiWorkerMirrored, 3 workers on 3 hosts: {rows[-1]['images_per_sec']:.0f} images/sec")
        rows, r = job_json(["-np", "2", "--ps", "1", "--", example, "--strategy=parameter_server"] + quick, 2)
        assert rows, r.stdout + r.stderr
        print(f"ok: ParameterServer, 2 workers + 1 ps on 3 hosts: {len(rows)} worker result(s)")

        # Ranks waiting on a slow link block in poll() rather than spin (next_spin_budget in
        # src/collectives/tcp/tcp_transport.h). dtrain-bench allreduce reports the CPU time of the
        # two ranks' processes per 8 MiB all-reduce (cpu_us: every thread, user and system), measured
        # inside the ranks over the timed all-reduces only. What the ranks burn on 200 Mbit/s links
        # beyond what the same all-reduce costs on unshaped links (the summing, copying and TCP work,
        # which a slow link does not change) is what waiting cost; as a share of the all-reduce's
        # time on the slow link it must stay small. The difference is checked rather than the raw
        # share because this VM runs the same work at 2-3x different speeds minutes apart.
        def allreduce(iters):
            r = sh(bench, "allreduce", "--backend", "tcp", "--ranks", "2", "--netns", prefix, "--warmup", "1",
                   "--sizes", "8M", "--iters", str(iters), "--json", timeout=120)
            row = [json.loads(l) for l in r.stdout.splitlines() if l.startswith("{")][-1]
            return row["cpu_us"] / 1e6, row["time_us"] / 1e6
        def relink(rate):
            for host in ("0", "1"):
                sh(netns, "link", "--prefix", prefix, host, "--rate", rate)
        relink("none")
        work, fast = allreduce(6)
        relink("200mbit")
        tries = []
        for _ in range(2):  # a second try only when the first is over: a spinning transport is over in both
            cpu, wall = allreduce(6)
            tries.append(((cpu - work) / wall, cpu, wall))
            if tries[-1][0] < 0.065:
                break
        waste, cpu, wall = min(tries)
        print(f"ok: an 8 MiB all-reduce of two ranks over 200 Mbit/s links: {wall:.3f} s, {cpu * 1e3:.1f} ms of CPU; "
              f"unshaped {fast * 1e3:.1f} ms, {work * 1e3:.1f} ms of CPU; {waste:+.3f} of a core burnt waiting "
              f"({len(tries)} tr{'y' if len(tries) == 1 else 'ies'})")
        assert wall > 0.25, f"an 8 MiB all-reduce took {wall:.3f} s: the links are not shaped to 200 Mbit/s"
        assert waste < 0.065, (f"two ranks waiting on 200 Mbit/s links burnt {waste:.3f} of a core beyond the "
                               f"work the same all-reduce takes unshaped (at most 0.065; 0.014-0.040 measured, "
                               "a fixed 100 us spin 0.092-0.094): the TCP transport spins where it should block")

        # allreduce --compute-probe (what bench/links/links.py charges the step model): with a compute
        # thread beside each rank, the all-reduces on unshaped links must take from the probes at least
        # half of what the ranks themselves spend (Zen 5, 2 hosts: 0.50-0.59 ns of the probes' core time
        # a byte moved, the ranks 0.45-0.52), and the ranks' cpu_us must leave the probe's own CPU out.
        # A second try only where the first misses: this VM's speed can move within the window.
        relink("none")
        tries = []
        for _ in range(2):
            r = sh(bench, "allreduce", "--backend", "tcp", "--ranks", "2", "--netns", prefix, "--warmup", "1",
                   "--sizes", "16M", "--iters", "60", "--compute-probe", "--json", timeout=120)
            row = [json.loads(l) for l in r.stdout.splitlines() if l.startswith("{")][-1]
            lost, cpu, wall = row["compute_lost_ns_per_byte"], row["cpu_us"] / 1e6, row["time_us"] / 1e6
            ranks_ns = cpu / (2 * 16 * 2**20) * 1e9  # both ranks' CPU over both ranks' bytes, per all-reduce
            tries.append((lost, ranks_ns, cpu, wall))
            if lost >= 0.5 * ranks_ns:
                break
        lost, ranks_ns, cpu, wall = tries[-1]
        print(f"ok: a 16 MiB all-reduce beside a compute probe: {wall * 1e3:.1f} ms, ranks' CPU {cpu * 1e3:.1f} ms "
              f"({ranks_ns:.2f} ns a byte), {lost:.2f} ns of the probes' core time lost a byte moved "
              f"({len(tries)} tr{'y' if len(tries) == 1 else 'ies'})")
        assert lost >= 0.5 * ranks_ns, (f"the probes lost {lost:.3f} ns of core time a byte moved, less than half the "
                                        f"ranks' own {ranks_ns:.3f}: the probe does not see the all-reduce")
        assert cpu < 1.2 * wall, (f"the ranks' CPU {cpu:.4f} s per all-reduce of {wall:.4f} s: the probe's own CPU "
                                  "is counted in it (0.5-0.8 of the wall time without it; 1.9 in a run with it "
                                  "counted)")
    finally:
        sh(netns, "down", "--prefix", prefix, check=False)
    left = [l for l in sh("ip", "netns", "list").stdout.splitlines() if l.startswith(prefix + "-")]
    assert not left, left
    print("ok: every namespace removed")
    return 0

if __name__ == "__main__":
    sys.exit(main())
