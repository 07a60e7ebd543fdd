#!/usr/bin/env python3
"""examples/linear_regression: 1, 2 and 4 replicas (Mirrored) and 2 worker processes (MWMS) at the same
global batch follow the same (a, b) trajectory step by step (within 1e-5: only float reassociation
differs); every run recovers a = 2, b = -1 within 0.03; batch 1 and the full batch converge too; and the
plot script draws them.

  linear_regression_test.py LINEAR_REGRESSION DTRAIN_RUN PLOT_SCRIPT
"""
import csv, json, os, subprocess, sys, tempfile

def run(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        sys.exit(f"failed ({r.returncode}): {' '.join(cmd)}\n{r.stdout}\n{r.stderr}")
    return json.loads([l.split("] ", 1)[-1] for l in r.stdout.splitlines() if '"a_error"' in l][-1])

def rows(path):
    return [(int(r["step"]), float(r["a"]), float(r["b"])) for r in csv.DictReader(open(path))]

def main():
    binary, dtrain_run, plot = sys.argv[1:4]
    with tempfile.TemporaryDirectory() as d:
        runs = {"1 replica": [binary, "--strategy=one_device"], "2 replicas": [binary, "--strategy=mirrored", "--devices=cpu:2"],
                "4 replicas": [binary, "--strategy=mirrored", "--devices=cpu:4"],
                "2 workers": [dtrain_run, "-np", "2", "--", binary, "--strategy=multi_worker_mirrored"]}
        paths = {}
        for name, cmd in runs.items():
            paths[name] = os.path.join(d, name.replace(" ", "_") + ".csv")
            j = run(cmd + ["--batch-size=32", "--json", "--trajectory", paths[name]])
            if j["a_error"] > 0.03 or j["b_error"] > 0.03 or j["global_batch"] != 32:
                sys.exit(f"{name}: did not recover the line: {j}")
        ref = rows(paths["1 replica"])
        for name, path in paths.items():
            got = rows(path)
            if len(got) != len(ref):
                sys.exit(f"{name}: {len(got)} steps, 1 replica {len(ref)}")
            worst = max(max(abs(x[1] - y[1]), abs(x[2] - y[2])) for x, y in zip(got, ref))
            if worst > 1e-5:
                sys.exit(f"{name}: trajectory differs from 1 replica by {worst}")
            print(f"ok: {name}: {len(got)} steps, largest difference from 1 replica {worst:.1e}")
        for flags in (["--batch-size=1", "--epochs=1", "--lr=0.02"], ["--batch-size=0", "--epochs=60", "--lr=0.5"]):
            j = run([binary, "--json"] + flags + ["--trajectory", os.path.join(d, "x.csv")])
            if j["a_error"] > 0.03 or j["b_error"] > 0.03:
                sys.exit(f"{flags}: did not converge: {j}")
            print(f"ok: {' '.join(flags)}: a = {j['a']:.4f}, b = {j['b']:.4f}")
        py = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
        png = os.path.join(d, "lr.png")
        r = subprocess.run([py, plot, "--out", png, "--labels", ",".join(paths)] + list(paths.values()),
                           capture_output=True, text=True, timeout=120)
        if r.returncode == 0:
            print(f"ok: plot {os.path.getsize(png)} bytes")
        elif "needs matplotlib" not in r.stdout + r.stderr:
            sys.exit(f"plot failed:\n{r.stdout}{r.stderr}")

if __name__ == "__main__":
    main()
