"""dtrain-bench compare with a peer that fails: it is said once, left out of its row (the table
says "failed", no JSON result), not run again in later rounds, and the other systems' results
stand. The peers are a stand-in interpreter: imports succeed, TensorFlow's script fails with a
message, the PyTorch scripts print a fixed result; dtrain's own example runs for real.

usage: compare_peer_failure_test.py DTRAIN_BENCH
"""
import json
import os
import stat
import subprocess
import sys
import tempfile

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
        cmd = [bench, "compare", "--model", "reference_cnn", "--rows", "one_thread",
               "--batch-sizes", "64", "--runs", "2", "--steps", "20", "--warmup", "2",
               "--peers-python", fake, "--debian-python", fake, "--json"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    print(r.stdout)
    print(r.stderr, file=sys.stderr)
    problems = []
    if r.returncode != 0:
        problems.append(f"exit code {r.returncode}")
    said = [l for l in r.stderr.splitlines() if l.startswith("compare: TensorFlow failed")]
    if len(said) != 1:
        problems.append(f"the failure was said {len(said)} times, not once")
    elif "(batch 64, one_thread row)" not in said[0]:
        problems.append("the failure does not name its batch and row: " + said[0])
    if "could not create a primitive descriptor" not in r.stderr:
        problems.append("the peer's own message is not shown")
    rows = [json.loads(l) for l in r.stdout.splitlines() if l.startswith("{")]
    systems = sorted(x["system"] for x in rows)
    if systems != ["dtrain", "torch", "torch113"]:
        problems.append(f"JSON results for {systems}, want dtrain, torch, torch113")
    if not any(x["system"] == "dtrain" and x["images_per_sec"] > 0 for x in rows):
        problems.append("no dtrain result")
    table = [l for l in r.stdout.splitlines() if l.startswith("one process, one thread")]
    if len(table) != 1 or "failed" not in table[0]:
        problems.append("the table's row does not say failed: " + repr(table))
    for p in problems:
        print("FAIL:", p)
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
