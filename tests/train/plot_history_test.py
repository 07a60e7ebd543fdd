#!/usr/bin/env python3
"""tools/plot/plot_history.py draws two CSV logs into a PNG (checked by its signature and size)."""
import os, subprocess, sys, tempfile

def main():
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("SKIPPED: matplotlib is not installed (apt-get install python3-matplotlib)")
        sys.exit(77)
    script = sys.argv[1]
    with tempfile.TemporaryDirectory() as d:
        logs = []
        for run, scale in (("a", 1.0), ("b", 0.8)):
            path = os.path.join(d, run + ".csv")
            with open(path, "w") as f:
                f.write("epoch,accuracy,learning_rate,loss,val_accuracy,val_loss\n")
                for e in range(5):
                    f.write(f"{e},{0.7 + 0.04 * e},{0.001},{scale / (e + 1)},{0.68 + 0.04 * e},{scale / (e + 1.2)}\n")
            logs.append(path)
        out = os.path.join(d, "curves.png")
        r = subprocess.run([sys.executable, script, "--out", out, "--labels", "one,two"] + logs,
                           capture_output=True, text=True, timeout=100)
        if r.returncode != 0:
            sys.exit(f"plot_history.py failed:\n{r.stdout}{r.stderr}")
        with open(out, "rb") as f:
            head = f.read(8)
        if head != b"\x89PNG\r\n\x1a\n" or os.path.getsize(out) < 10000:
            sys.exit(f"not a plausible PNG: {head!r}, {os.path.getsize(out)} bytes")
        bad = subprocess.run([sys.executable, script, "--out", out, os.path.join(d, "missing.csv")],
                             capture_output=True, text=True, timeout=100)
        if bad.returncode == 0:
            sys.exit("a missing CSV was accepted")
        print(f"ok: {os.path.getsize(out)} byte PNG with 3 panels; a missing file is refused")

if __name__ == "__main__":
    main()
