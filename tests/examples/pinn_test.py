#!/usr/bin/env python3
"""examples/pinn: the relative L2 error against sin(pi x) is <= 1e-2 under one_device, mirrored cpu:2
2 MWMS workers (the same collocation points split over replicas or workers) and as an ensemble of 3, and the plot script
draws the solutions.

  pinn_test.py PINN DTRAIN_RUN PLOT_SCRIPT
"""
import json, os, subprocess, sys, tempfile

def run(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        sys.exit(f"failed ({r.returncode}): {' '.join(cmd)}\n{r.stdout}\n{r.stderr}")
    return json.loads([l.split("] ", 1)[-1] for l in r.stdout.splitlines() if "relative_l2_error" in l][-1])

def main():
    binary, dtrain_run, plot = sys.argv[1:4]
    with tempfile.TemporaryDirectory() as d:
        runs = {"one_device": [binary], "mirrored cpu:2": [binary, "--strategy=mirrored", "--devices=cpu:2"],
                "2 MWMS workers": [dtrain_run, "-np", "2", "--", binary, "--strategy=multi_worker_mirrored"],
                "ensemble of 3": [binary, "--strategy=ensemble", "--devices=cpu:3"]}
        csvs = []
        for name, cmd in runs.items():
            csvs.append(os.path.join(d, f"{len(csvs)}.csv"))
            j = run(cmd + ["--steps=1500", "--json", "--solution", csvs[-1]])
            if not j["relative_l2_error"] <= 1e-2 or j["steps"] != 1500 or j["members"] != (3 if "ensemble" in name else 1):
                sys.exit(f"{name}: {j}")
            print(f"ok: {name}: relative L2 error {j['relative_l2_error']:.2e} in {j['seconds']:.1f} s")
        py = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
        png = os.path.join(d, "p.png")
        r = subprocess.run([py, plot] + csvs + ["--labels", ",".join(runs), "--out", png], capture_output=True, text=True,
                           timeout=120)
        if r.returncode == 0:
            print(f"ok: plot {os.path.getsize(png)} bytes")
        elif "needs matplotlib" not in r.stdout + r.stderr:
            sys.exit(f"plot failed:\n{r.stdout}{r.stderr}")

if __name__ == "__main__":
    main()
