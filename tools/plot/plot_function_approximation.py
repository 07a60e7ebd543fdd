#!/usr/bin/env python3
"""examples/function_approximation in one PNG: the target f, the noisy samples, a data-parallel fit
and an ensemble's mean with its +-2 standard deviation band.

  plot_function_approximation.py --data data.csv --fit mirrored.csv --ensemble ens.csv --out fa.png
"""
import argparse, csv, sys
import plotlib  # tools/plot/plotlib.py, beside this script

def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="--data CSV (x,y)")
    p.add_argument("--fit", required=True, help="--predictions CSV of a data-parallel run")
    p.add_argument("--fit-label", default="data-parallel fit")
    p.add_argument("--ensemble", required=True, help="--predictions CSV of an ensemble run")
    p.add_argument("--ensemble-label", default="ensemble mean")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    plt = plotlib.pyplot(__file__)
    data = list(csv.DictReader(open(a.data)))
    fit = list(csv.DictReader(open(a.fit)))
    ens = list(csv.DictReader(open(a.ensemble)))
    col = lambda rows, k: [float(r[k]) for r in rows]
    fig, ax = plt.subplots(1, 2, figsize=(13, 4.6), gridspec_kw={"width_ratios": [3, 2]})
    x = col(ens, "x")
    mean, sd = col(ens, "mean"), col(ens, "stddev")
    ax[0].fill_between(x, [m - 2 * s for m, s in zip(mean, sd)], [m + 2 * s for m, s in zip(mean, sd)],
                       color="#ff9800", alpha=0.3, label=f"{a.ensemble_label} +- 2 sd")
    ax[0].plot(col(data, "x"), col(data, "y"), ".", color="#9e9e9e", ms=4, label="noisy samples")
    ax[0].plot(col(fit, "x"), col(fit, "target"), "k-", lw=2.5, alpha=0.35, label="target sin(2 pi x) exp(-x)")
    ax[0].plot(col(fit, "x"), col(fit, "mean"), "-", color="#1976d2", lw=1.4, label=a.fit_label)
    ax[0].plot(x, mean, "--", color="#e65100", lw=1.4, label=a.ensemble_label)
    ax[0].set_xlabel("x")
    ax[0].legend(fontsize=8)
    ax[0].grid(alpha=0.3)
    ax[0].set_title("fit and ensemble")
    ax[1].plot(col(fit, "x"), [m - t for m, t in zip(col(fit, "mean"), col(fit, "target"))], color="#1976d2",
               label=a.fit_label + " - target")
    ax[1].plot(x, [m - t for m, t in zip(mean, col(ens, "target"))], "--", color="#e65100", label=a.ensemble_label + " - target")
    ax[1].fill_between(x, [-2 * s for s in sd], [2 * s for s in sd], color="#ff9800", alpha=0.3, label="+- 2 sd of the members")
    ax[1].axhline(0, color="k", lw=0.6)
    ax[1].set_xlabel("x")
    ax[1].set_title("error against the target")
    ax[1].legend(fontsize=8)
    ax[1].grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    print(f"wrote {a.out}")

if __name__ == "__main__":
    main()
