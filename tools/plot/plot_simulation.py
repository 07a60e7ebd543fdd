#!/usr/bin/env python3
"""`dtrain-bench simulate --json` as a PNG: predicted scaling efficiency against workers, one line per link
speed (and pack size, dashed for the larger, when a file has several) and one panel per model, with
published figures as points where given.

  dtrain-bench simulate --profile resnet.json ... --json > resnet.txt
  plot_simulation.py "ResNet-50=resnet.txt" "GPT-2 small=gpt.txt" --out simulation.png \
      [--published "ResNet-50=512:0.90:Horovod, ResNet-101, 25 Gbit/s"]
"""
import argparse, json, sys
import plotlib  # tools/plot/plotlib.py, beside this script


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("panels", nargs="+", help="TITLE=FILE: a panel from a file of simulate --json lines")
    p.add_argument("--out", required=True)
    p.add_argument("--published", action="append", default=[],
                   help="TITLE=WORKERS:EFFICIENCY:LABEL, a published measurement drawn as a point")
    p.add_argument("--suptitle", default="")
    a = p.parse_args()
    plt = plotlib.pyplot(__file__)
    panels = []
    for spec in a.panels:
        title, _, path = spec.partition("=")
        rows = [json.loads(l) for l in open(path) if l.startswith("{") and '"simulate"' in l]
        if not rows:
            sys.exit(f"{path}: no 'simulate' JSON lines (run dtrain-bench simulate --json)")
        panels.append((title, rows))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.6 * len(panels), 5.2), squeeze=False)
    for ax, (title, rows) in zip(axes[0], panels):
        # A run with --pack-mb auto (dtrain's rule) changes its pack size with the worker count: one line.
        def pack_of(r):
            return "auto" if r.get("pack_rule") == "auto" else r["pack_bytes"]
        packs = sorted({pack_of(r) for r in rows}, key=lambda p: (p != "auto", 0 if p == "auto" else p))
        colors = {}
        for link, pack in dict.fromkeys((r["link"], pack_of(r)) for r in rows):
            rs = sorted((r for r in rows if r["link"] == link and pack_of(r) == pack), key=lambda r: r["workers"])
            name = "packs by worker count" if pack == "auto" else f"{pack / 2**20:.0f} MiB packs"
            label = link + (f", {name}" if len(packs) > 1 else "")
            style = "-o" if pack == packs[0] else "--s"
            line, = ax.plot([r["workers"] for r in rs], [100 * r["efficiency"] for r in rs], style, ms=4,
                            label=label, color=colors.get(link))
            colors.setdefault(link, line.get_color())
        for pub in a.published:
            t, _, rest = pub.partition("=")
            if t != title:
                continue
            w, e, label = rest.split(":", 2)
            ax.plot([float(w)], [100 * float(e)], "k*", ms=11, label=label)
        ax.set_xscale("log", base=2)
        ax.set_ylim(0, 105)
        ax.set_xlabel("workers (GPUs)")
        ax.set_ylabel("scaling efficiency, %")
        step = rows[0]["compute_seconds"]
        ax.set_title(f"{title}: {rows[0]['gradient_bytes'] / 1e6:.0f} MB of gradients, "
                     f"{step * 1e3:.0f} ms step", fontsize=10)
        ax.grid(True, alpha=0.3)
    handles = {}
    for ax in axes[0]:
        for h, l in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(l, h)
    fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=min(4, len(handles)), fontsize=8)
    if a.suptitle:
        fig.suptitle(a.suptitle, fontsize=10)
    fig.tight_layout(rect=(0, 0.04 + 0.035 * ((len(handles) + 3) // 4), 1, 1))
    fig.savefig(a.out, dpi=110)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
