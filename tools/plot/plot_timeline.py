#!/usr/bin/env python3
"""A Gantt chart (PNG) of a few steps of a dtrain timeline (DTRAIN_TIMELINE / --timeline-filename).

One row per thread of every rank, bars coloured by what they are (input, forward, backward, gradient
packs and their all-reduce stages, optimizer update), time in milliseconds from the first step shown.

  tools/plot/plot_timeline.py TIMELINE.json --out timeline.png [--first-step 5] [--steps 3]
"""
import argparse, json, sys
import plotlib  # tools/plot/plotlib.py, beside this script

COLOURS = [("input", "#9e9e9e"), ("step", "#e0e0e0"), ("forward", "#4caf50"), ("backward", "#2196f3"),
           ("wait for its gradients", "#ffe082"), ("pack", "#ff9800"), ("unpack", "#ff9800"),
           ("stage 1", "#ab47bc"), ("stage 2", "#d32f2f"), ("stage 3", "#7e57c2"), ("all-reduce", "#e57373"),
           ("reduce-scatter", "#e57373"), ("all-gather", "#f48fb1"), ("barrier", "#5d4037"), ("hvd", "#d32f2f"),
           ("optimizer", "#00897b"), ("accumulate", "#80cbc4"), ("evaluate", "#bdbdbd")]

def colour(name):
    for key, c in COLOURS:
        if key in name:
            return c, key
    return "#607d8b", "other"

def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("timeline")
    p.add_argument("--out", required=True)
    p.add_argument("--first-step", type=int, default=5, help="first step shown (1-based; skips warm-up)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--title", default="dtrain timeline")
    a = p.parse_args()
    plt = plotlib.pyplot(__file__)
    from matplotlib.patches import Patch
    events = json.load(open(a.timeline))["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    spans = [e for e in events if e.get("ph") == "X"]
    steps = sorted((e for e in spans if e["name"].startswith("step ") and e["pid"] == min(procs or [0])),
                   key=lambda e: e["ts"])
    if not steps:
        sys.exit(f"{a.timeline}: no 'step N' events (was it written by fit()?)")
    first = min(max(a.first_step, 1), len(steps)) - 1
    shown = steps[first:first + a.steps]
    t0 = shown[0]["ts"]
    t1 = shown[-1]["ts"] + shown[-1]["dur"]
    rows = sorted({(e["pid"], e["tid"]) for e in spans if e["ts"] < t1 and e["ts"] + e["dur"] > t0})
    fig, ax = plt.subplots(figsize=(13, 0.5 * len(rows) + 1.6))
    used = {}
    for y, row in enumerate(rows):
        mine = sorted((e for e in spans if (e["pid"], e["tid"]) == row and e["ts"] < t1 and e["ts"] + e["dur"] > t0),
                      key=lambda e: (e["ts"], -e["dur"]))
        stack = []  # ends of the enclosing events: nested events are drawn thinner, on top
        for e in mine:
            while stack and stack[-1] <= e["ts"]:
                stack.pop()
            depth = len(stack)
            stack.append(e["ts"] + e["dur"])
            c, key = colour(e["name"])
            used[key] = c
            height = max(0.85 - 0.22 * depth, 0.2)
            ax.broken_barh([((e["ts"] - t0) / 1e3, max(e["dur"], 1) / 1e3)], (y - height / 2, height),
                           facecolors=c, edgecolors="black", linewidth=0.2, zorder=2 + depth)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"{procs.get(p, p)} / {threads.get((p, t), t)}" for p, t in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("milliseconds")
    ax.set_xlim(0, (t1 - t0) / 1e3)
    ax.grid(axis="x", alpha=0.3)
    ax.legend(handles=[Patch(color=c, label=k) for k, c in used.items()], fontsize=7, ncol=min(6, len(used)),
              loc="upper center", bbox_to_anchor=(0.5, -0.12))
    ax.set_title(f"{a.title}: steps {first + 1}-{first + len(shown)}")
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    print(f"wrote {a.out}")

if __name__ == "__main__":
    main()
