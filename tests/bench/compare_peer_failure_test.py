"""dtrain-bench compare with peers that fail: each is said once, left out of its row (the table
says "failed", no JSON result), not run again in later rounds, and the other systems' results
stand. The peers are stand-in interpreters: imports succeed, TensorFlow's script fails with a
message from the first round, "Debian's PyTorch" from the second (its first round's result must be
dropped too, not kept as a median of fewer rounds), PyTorch 2.x prints a fixed result; dtrain's
own example runs for real.

usage: compare_peer_failure_test.py DTRAIN_BENCH
"""
import json
import re
import os
import stat
import subprocess
import sys
import tempfile

DEBIAN = r"""#!/bin/bash
case "$*" in
  "-c import "*) exit 0 ;;
esac
n=$(cat "$(dirname "$0")/runs" 2>/dev/null || echo 0)
echo $((n + 1)) >"$(dirname "$0")/runs"
if [ "$n" -ge 1 ]; then echo "Segmentation fault in the second round" >&2; exit 139; fi
echo '{"images_per_sec": 500.0, "peak_rss_mb": 10}'
"""

FAKE = r"""#!/bin/bash
case "$*" in
  "-c import "*) exit 0 ;;
  *tf_fashion_mnist.py*) echo "RuntimeError: could not create a primitive descriptor" >&2; exit 3 ;;
  *) echo '{"images_per_sec": 1000.0, "peak_rss_mb": 10}' ;;
esac
"""


def main():
    bench = sys.argv[1]
    with tempfile.TemporaryDirectory() as d:
        fake = os.path.join(d, "python")
        with open(fake, "w") as f:
            f.write(FAKE)
        os.chmod(fake, stat.S_IRWXU)
        os.mkdir(os.path.join(d, "debian"))
        debian = os.path.join(d, "debian", "python")
        with open(debian, "w") as f:
            f.write(DEBIAN)
        os.chmod(debian, stat.S_IRWXU)
        cmd = [bench, "compare", "--model", "reference_cnn", "--rows", "one_thread",
               "--batch-sizes", "64", "--runs", "3", "--steps", "20", "--warmup", "2",
               "--peers-python", fake, "--debian-python", debian, "--json"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    print(r.stdout)
    print(r.stderr, file=sys.stderr)
    problems = []
    if r.returncode != 0:
        problems.append(f"exit code {r.returncode}")
    for peer, message in (("TensorFlow", "could not create a primitive descriptor"),
                          ("PyTorch 1.13", "Segmentation fault in the second round")):
        said = [l for l in r.stderr.splitlines() if l.startswith(f"compare: {peer} failed")]
        if len(said) != 1:
            problems.append(f"{peer}'s failure was said {len(said)} times, not once")
        elif "(batch 64, one_thread row)" not in said[0]:
            problems.append("the failure does not name its batch and row: " + said[0])
        if message not in r.stderr:
            problems.append(f"{peer}'s own message is not shown")
    rows = [json.loads(l) for l in r.stdout.splitlines() if l.startswith("{")]
    systems = sorted(x["system"] for x in rows)
    if systems != ["dtrain", "torch"]:
        problems.append(f"JSON results for {systems}, want dtrain and torch")
    if not any(x["system"] == "dtrain" and x["images_per_sec"] > 0 for x in rows):
        problems.append("no dtrain result")
    table = [l for l in r.stdout.splitlines() if l.startswith("one process, one thread")]
    if len(table) != 1 or table[0].count("failed") != 2:
        problems.append("the table's row does not say failed: " + repr(table))
    rounds = [l for l in r.stderr.splitlines() if l.startswith("round ")]
    if not rounds or not all(re.search(r" steal +(\d+\.\d%|n/a)$", l) for l in rounds):
        problems.append("a round's line does not say the hypervisor's steal: " + repr(rounds[:2]))
    if not all("steal_max" in x and (x["steal_max"] is None or 0 <= x["steal_max"] < 1)
               for x in rows):
        problems.append("a JSON result has no steal_max in [0, 1) (or null: unknown)")
    if "hypervisor steal (/proc/stat" not in r.stdout:
        problems.append("the table has no steal line")
    for p in problems:
        print("FAIL:", p)
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
