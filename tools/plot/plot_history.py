#!/usr/bin/env python3
"""Training curves as a PNG, for people who do not run TensorBoard.

Reads the CSV logs that --csv-log (CSVLogger) writes, one per run, and draws loss and every metric
per epoch, training and validation, one panel per quantity, one colour per run.

  tools/plot/plot_history.py --out curves.png run1.csv [run2.csv ...] [--labels a,b]
"""
import argparse, csv, sys
import plotlib  # tools/plot/plotlib.py, beside this script

def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("csv", nargs="+", help="CSVLogger files")
    p.add_argument("--out", required=True, help="PNG to write")
    p.add_argument("--labels", help="comma-separated run names (default: the file names)")
    p.add_argument("--title", default="dtrain training curves")
    a = p.parse_args()
    plt = plotlib.pyplot(__file__)
    from matplotlib.ticker import MaxNLocator
    labels = plotlib.per_file(a.labels, a.csv) if a.labels else a.csv
    if len(labels) != len(a.csv):
        sys.exit(f"--labels has {len(labels)} names for {len(a.csv)} files")
    runs = []
    for path in a.csv:
        with open(path) as f:
            rows = list(csv.DictReader(f))
        if not rows:
            sys.exit(f"{path}: no rows (did training run a whole epoch?)")
        runs.append(rows)
    keys = [k for k in runs[0][0] if k != "epoch" and not k.startswith("val_")]
    keys = [k for k in keys if k != "learning_rate"] + (["learning_rate"] if "learning_rate" in keys else [])
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.6), squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, key in zip(axes[0], keys):
        for i, (rows, label) in enumerate(zip(runs, labels)):
            epochs = [int(r["epoch"]) + 1 for r in rows]
            c = colours[i % len(colours)]
            ax.plot(epochs, [float(r[key]) for r in rows], "-o", color=c, ms=3, label=f"{label} train")
            if "val_" + key in rows[0] and rows[0]["val_" + key] != "":
                ax.plot(epochs, [float(r["val_" + key]) for r in rows], "--s", color=c, ms=3, label=f"{label} test")
        ax.set_title(key)
        ax.set_xlabel("epoch")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(a.title)
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    print(f"wrote {a.out}")

if __name__ == "__main__":
    main()
