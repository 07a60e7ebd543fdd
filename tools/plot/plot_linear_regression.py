#!/usr/bin/env python3
"""Loss and parameter trajectories of examples/linear_regression runs, in one PNG.

Each CSV is one run's --trajectory (step, epoch, a, b, full-data loss). Panels: the loss against
epochs (log scale), a and b against epochs, and the path in the (a, b) plane over the loss's
contours (for x ~ U[-1, 1]: L = (a - a*)^2 / 3 + (b - b*)^2 + noise^2).

  plot_linear_regression.py --out lr.png --labels "batch 1,batch 32" b1.csv b32.csv [--a 2 --b -1 --noise 0.1]
"""
import argparse, csv, sys
import plotlib  # tools/plot/plotlib.py, beside this script

def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("csv", nargs="+")
    p.add_argument("--out", required=True)
    p.add_argument("--labels", required=True, help="comma-separated, one per CSV")
    p.add_argument("--styles", help="comma-separated matplotlib line styles, one per CSV (e.g. -,--,:)")
    p.add_argument("--a", type=float, default=2.0)
    p.add_argument("--b", type=float, default=-1.0)
    p.add_argument("--noise", type=float, default=0.1)
    a = p.parse_args()
    plt = plotlib.pyplot(__file__)
    import numpy as np
    labels = plotlib.per_file(a.labels, a.csv)
    styles = plotlib.per_file(a.styles, a.csv, "--styles") if a.styles else ["-"] * len(a.csv)
    if len(labels) != len(a.csv) or len(styles) != len(a.csv):
        sys.exit("give one label (and style) per CSV")
    fig, ax = plt.subplots(1, 3, figsize=(15, 4.4))
    A, B = np.meshgrid(np.linspace(-0.3, 2.6, 200), np.linspace(-1.5, 0.3, 200))
    L = (A - a.a) ** 2 / 3 + (B - a.b) ** 2 + a.noise ** 2
    ax[2].contour(A, B, L, levels=np.geomspace(a.noise ** 2 * 1.05, L.max(), 12), colors="#bbbbbb", linewidths=0.6)
    ax[2].plot([a.a], [a.b], "k*", ms=12, label="true (a, b)")
    for path, label, style in zip(a.csv, labels, styles):
        rows = list(csv.DictReader(open(path)))
        e = [float(r["epoch"]) for r in rows]
        if len(e) > 1 and e[0] == 0:
            e[0] = e[1] / 2  # the starting point, on a log axis
        line, = ax[0].plot(e, [float(r["loss"]) for r in rows], style, lw=1.4, label=label)
        c = line.get_color()
        ax[1].plot(e, [float(r["a"]) for r in rows], style, color=c, lw=1.4)
        ax[1].plot(e, [float(r["b"]) for r in rows], style, color=c, lw=1.4)
        ax[2].plot([float(r["a"]) for r in rows], [float(r["b"]) for r in rows], style, color=c, lw=1.2, label=label)
    ax[0].set_yscale("log")
    ax[0].set_xscale("log")
    ax[1].set_xscale("log")
    ax[0].set_xlabel("epochs (log)")
    ax[0].set_ylabel("loss on all points (MSE)")
    ax[0].legend(fontsize=8)
    ax[1].axhline(a.a, color="k", lw=0.6, ls=":")
    ax[1].axhline(a.b, color="k", lw=0.6, ls=":")
    ax[1].set_xlabel("epochs (log)")
    ax[1].set_ylabel("a (upper curves) and b (lower)")
    ax[2].set_xlabel("a")
    ax[2].set_ylabel("b")
    ax[2].set_title("path in parameter space")
    ax[2].legend(fontsize=7)
    for x in ax:
        x.grid(alpha=0.3)
    fig.suptitle(f"SGD on y = {a.a:g}x + ({a.b:g}) + noise: batch size changes the path, replicas do not")
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    print(f"wrote {a.out}")

if __name__ == "__main__":
    main()
