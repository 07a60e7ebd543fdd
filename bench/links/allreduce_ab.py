#!/usr/bin/env python3
"""Two builds of dtrain's TCP all-reduce against each other on 2 test hosts (tools/netns/dtrain-netns),
unshaped and at 1 Gbit/s, in interleaved rounds: the ranks' CPU seconds per byte moved (6 more 64 MiB
all-reduces, both ranks' user + system time over the 2 x 64 MiB they move in each) and the all-reduce's
time at 4 KiB and 64 MiB. Medians of the rounds.

  bench/links/allreduce_ab.py A/dtrain-bench B/dtrain-bench [--names A,B] [--rounds 3] [--rates none,1gbit]

Each argument is a dtrain-bench binary (it starts its ranks from its own directory). Needs root.
"""
import argparse, json, os, resource, statistics, subprocess, time

NETNS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                     "tools", "netns", "dtrain-netns")
PREFIX = "arab"


def run(binary, sizes, iters):
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    r = subprocess.run([binary, "allreduce", "--backend", "tcp", "--ranks", "2", "--netns", PREFIX, "--warmup", "2",
                        "--json", "--sizes", sizes, "--iters", str(iters)], capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        raise SystemExit(f"{binary} allreduce failed ({r.returncode}):\n{r.stderr[-2000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return cpu, {j["bytes"]: j["time_us"] for j in map(json.loads, (l for l in r.stdout.splitlines() if l.startswith("{")))}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("a"), p.add_argument("b")
    p.add_argument("--names", default="A,B")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rates", default="none,1gbit")
    a = p.parse_args()
    names = a.names.split(",")
    up = subprocess.run([NETNS, "up", "--prefix", PREFIX, "--hosts", "2", "--rate", "none"], capture_output=True, text=True)
    if up.returncode != 0:
        raise SystemExit(f"dtrain-netns up failed ({up.returncode}): {up.stderr.strip()}")
    info = {k.strip(): v.strip() for k, v in (l.split(":", 1) for l in open("/proc/cpuinfo") if ":" in l)}
    print(f"CPU: {info.get('model name')} (family {info.get('cpu family')} model {info.get('model')}), "
          f"{time.strftime('%Y-%m-%d %H:%M')}", flush=True)
    res = {}
    try:
        for rate in a.rates.split(","):
            for h in (0, 1):
                subprocess.run([NETNS, "link", "--prefix", PREFIX, str(h), "--rate", rate], check=True)
            for rnd in range(a.rounds):
                for name, binary in zip(names, (a.a, a.b)):
                    c2, _ = run(binary, "64M", 2)
                    c8, _ = run(binary, "64M", 8)
                    ns = (c8 - c2) / (6 * 2 * 64 * 2**20) * 1e9
                    _, t = run(binary, "4K,64M", 30)
                    res.setdefault((rate, name), []).append((ns, t[4096], t[64 * 2**20] / 1e3))
                    print(f"round {rnd + 1} {rate:6s} {name:16s}: {ns:.2f} CPU ns/byte, 4 KiB {t[4096]:.0f} us, "
                          f"64 MiB {t[64 * 2**20] / 1e3:.1f} ms", flush=True)
    finally:
        subprocess.run([NETNS, "down", "--prefix", PREFIX], capture_output=True)
    print(f"\nmedians of {a.rounds} rounds: link, build, CPU ns per byte moved (both ranks), 4 KiB all-reduce us, "
          "64 MiB all-reduce ms")
    for (rate, name), v in res.items():
        print(f"{rate:6s} {name:16s} {statistics.median(x[0] for x in v):6.2f} {statistics.median(x[1] for x in v):7.0f} "
              f"{statistics.median(x[2] for x in v):8.1f}")


if __name__ == "__main__":
    main()
