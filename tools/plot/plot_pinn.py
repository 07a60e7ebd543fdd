#!/usr/bin/env python3
"""The PINN's solution (examples/pinn --solution) beside sin(pi x), and the pointwise error, in one PNG.

  plot_pinn.py run.csv [more.csv ...] --labels a,b --out pinn.png
"""
import argparse, csv, sys
import plotlib  # tools/plot/plotlib.py, beside this script

def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("csv", nargs="+")
    p.add_argument("--labels", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    plt = plotlib.pyplot(__file__)
    labels = plotlib.per_file(a.labels, a.csv)
    if len(labels) != len(a.csv):
        sys.exit("give one label per CSV")
    fig, ax = plt.subplots(1, 2, figsize=(12, 4.2))
    for i, (path, label) in enumerate(zip(a.csv, labels)):
        rows = list(csv.DictReader(open(path)))
        x = [float(r["x"]) for r in rows]
        if i == 0:
            ax[0].plot(x, [float(r["exact"]) for r in rows], "k-", lw=3, alpha=0.25, label="exact: sin(pi x)")
        line, = ax[0].plot(x, [float(r["u"]) for r in rows], "--", lw=1.3, label=f"PINN: {label}")
        ax[1].plot(x, [float(r["error"]) for r in rows], lw=1.2, color=line.get_color(), label=label)
        sd = [float(r.get("stddev") or 0) for r in rows]
        if any(sd):  # an ensemble: the members' spread around its mean
            ax[1].fill_between(x, [-2 * s for s in sd], [2 * s for s in sd], color=line.get_color(), alpha=0.2,
                               label=f"{label}: +- 2 sd of the members")
    ax[0].set_title("u(x) for -u'' = pi^2 sin(pi x), u(0) = u(1) = 0")
    ax[1].set_title("pointwise error u - sin(pi x)")
    ax[1].axhline(0, color="k", lw=0.6)
    for x_ in ax:
        x_.set_xlabel("x")
        x_.grid(alpha=0.3)
        x_.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    print(f"wrote {a.out}")

if __name__ == "__main__":
    main()
