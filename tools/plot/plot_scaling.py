#!/usr/bin/env python3
"""`dtrain-bench scaling --json` as a PNG: images/sec and scaling efficiency against replicas, in one
process and across processes, beside independent one-replica jobs on their own cores (the machine's
ceiling).

  dtrain-bench scaling --json | tee scaling.txt; plot_scaling.py scaling.txt --out scaling.png
"""
import argparse, json, sys
import plotlib  # tools/plot/plotlib.py, beside this script

def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", help="dtrain-bench scaling --json output (other lines are ignored)")
    p.add_argument("--out", required=True)
    p.add_argument("--title", default="reference CNN on Fashion-MNIST, 1 thread per replica")
    a = p.parse_args()
    plt = plotlib.pyplot(__file__)
    rows = []
    for line in open(a.results):
        line = line.strip()
        if line.startswith("{") and '"scaling"' in line:
            rows.append(json.loads(line))
    if not rows:
        sys.exit(f"{a.results}: no 'scaling' JSON lines (run dtrain-bench scaling --json)")
    fig, ax = plt.subplots(1, 2, figsize=(11, 4.2))
    labels = {"in-process": "in-process (Mirrored)", "processes": "processes (MultiWorkerMirrored)",
              "independent": "independent jobs, one per core (machine ceiling)"}
    for mode, style in (("in-process", "-o"), ("processes", "--s"), ("independent", "-.^")):
        rs = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["replicas"])
        if not rs:
            continue  # older output, or --devices=gpu: no independent runs
        n = [r["replicas"] for r in rs]
        ax[0].plot(n, [r["images_per_sec"] for r in rs], style, label=labels[mode])
        ax[1].plot(n, [100 * r["efficiency"] for r in rs], style, label=labels[mode])
    n = sorted({r["replicas"] for r in rows})
    one = next(r["images_per_sec"] for r in rows if r["replicas"] == 1)
    ax[0].plot(n, [one * k for k in n], ":", color="gray", label="linear")
    ax[0].set_xlabel("replicas")
    ax[0].set_ylabel("images/sec")
    ax[1].set_xlabel("replicas")
    ax[1].set_ylabel("scaling efficiency (%)")
    ax[1].set_ylim(0, 110)
    ax[1].axhline(100, color="gray", ls=":")
    for x in ax:
        x.set_xticks(n)
        x.grid(alpha=0.3)
        x.legend(fontsize=8)
    fig.suptitle(a.title)
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    print(f"wrote {a.out}")

if __name__ == "__main__":
    main()
