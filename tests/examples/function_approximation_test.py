#!/usr/bin/env python3
"""examples/function_approximation: data-parallel fits (one_device, mirrored cpu:2, 2 MWMS workers)
reach RMSE < 0.05 against the target and agree with each other; an ensemble of 3 has 3 members, a
mean with RMSE < 0.06 and a non-zero spread; an ensemble over 2 workers x 2 devices gives exactly
what one process with 4 devices gives; an ensemble of one gives exactly the one_device fit; the
plot script draws them.

  function_approximation_test.py BINARY DTRAIN_RUN PLOT_SCRIPT
"""
import json, os, subprocess, sys, tempfile

def run(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        sys.exit(f"failed ({r.returncode}): {' '.join(cmd)}\n{r.stdout}\n{r.stderr}")
    return json.loads([l.split("] ", 1)[-1] for l in r.stdout.splitlines() if '"rmse"' in l][-1])

def main():
    binary, dtrain_run, plot = sys.argv[1:4]
    short = ["--epochs=300", "--json"]
    with tempfile.TemporaryDirectory() as d:
        one = run([binary] + short + ["--data", f"{d}/data.csv"])
        dp = {"one_device": one,
              "mirrored cpu:2": run([binary, "--strategy=mirrored", "--devices=cpu:2", "--predictions", f"{d}/fit.csv"] + short),
              "2 MWMS workers": run([dtrain_run, "-np", "2", "--", binary, "--strategy=multi_worker_mirrored"] + short)}
        for name, j in dp.items():
            if not j["rmse"] < 0.05 or abs(j["rmse"] - one["rmse"]) > 1e-3 or j["members"] != 1:
                sys.exit(f"{name}: {j} (one_device: {one})")
            print(f"ok: {name}: RMSE {j['rmse']:.4f}")
        ens = run([binary, "--strategy=ensemble", "--devices=cpu:3", "--predictions", f"{d}/ens.csv"] + short)
        if ens["members"] != 3 or not ens["rmse"] < 0.06 or not ens["inside_two_sd"] > 0:
            sys.exit(f"ensemble of 3: {ens}")
        print(f"ok: ensemble of 3: mean RMSE {ens['rmse']:.4f}, members {ens['member_rmse']:.4f}, "
              f"target inside +-2 sd on {100 * ens['inside_two_sd']:.0f}% of the grid")
        # Members as workers: 2 processes x 2 devices train the members of one process with 4 devices.
        four = run([binary, "--strategy=ensemble", "--devices=cpu:4"] + short)
        spread = run([dtrain_run, "-np", "2", "--", binary, "--strategy=ensemble", "--devices=cpu:2"] + short)
        if spread["members"] != 4 or spread["rmse"] != four["rmse"] or spread["member_rmse"] != four["member_rmse"]:
            sys.exit(f"an ensemble of 2 workers x 2 devices differs from one process with 4 devices: {spread} vs {four}")
        print(f"ok: ensemble over 2 workers x 2 devices = 1 process x 4 devices (mean RMSE {four['rmse']:.4f})")
        single = run([binary, "--strategy=ensemble", "--devices=cpu:1"] + short)
        if single["rmse"] != one["rmse"] or single["final_loss"] != one["final_loss"]:
            sys.exit(f"an ensemble of one differs from one_device: {single} vs {one}")
        print("ok: an ensemble of one gives exactly the one_device fit")
        py = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
        r = subprocess.run([py, plot, "--data", f"{d}/data.csv", "--fit", f"{d}/fit.csv", "--ensemble", f"{d}/ens.csv",
                            "--out", f"{d}/fa.png"], capture_output=True, text=True, timeout=120)
        if r.returncode == 0:
            print(f"ok: plot {os.path.getsize(d + '/fa.png')} bytes")
        elif "needs matplotlib" not in r.stdout + r.stderr:
            sys.exit(f"plot failed:\n{r.stdout}{r.stderr}")

if __name__ == "__main__":
    main()
