#!/usr/bin/env python3
"""tools/plot/plot_history.py draws two CSV logs into a PNG (checked by its signature and size);
labels may contain commas (';' separates them); run by an interpreter without matplotlib (a virtual
environment, as a pyenv or conda python3 is), the script reruns itself under Debian's python3."""
import os, subprocess, sys, tempfile

def png_ok(path):
    with open(path, "rb") as f:
        head = f.read(8)
    return head == b"\x89PNG\r\n\x1a\n" and os.path.getsize(path) >= 10000


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
        r = subprocess.run([sys.executable, script, "--out", out, "--labels", "batch 32, 2 replicas;two"] + logs,
                           capture_output=True, text=True, timeout=100)
        if r.returncode != 0:
            sys.exit(f"plot_history.py failed:\n{r.stdout}{r.stderr}")
        if not png_ok(out):
            sys.exit(f"not a plausible PNG: {os.path.getsize(out)} bytes")
        # An interpreter without matplotlib: a bare virtual environment.
        venv = os.path.join(d, "venv")
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True, timeout=60)
        other = os.path.join(d, "other.png")
        r = subprocess.run([os.path.join(venv, "bin", "python"), script, "--out", other, "--labels", "one,two"] + logs,
                           capture_output=True, text=True, timeout=100, env=dict(os.environ, DTRAIN_PLOT_REEXEC=""))
        if r.returncode != 0 or not png_ok(other):
            sys.exit(f"plot_history.py under a python3 without matplotlib did not rerun itself:\n{r.stdout}{r.stderr}")
        bad = subprocess.run([sys.executable, script, "--out", out, os.path.join(d, "missing.csv")],
                             capture_output=True, text=True, timeout=100)
        if bad.returncode == 0:
            sys.exit("a missing CSV was accepted")
        print(f"ok: {os.path.getsize(out)} byte PNG with 3 panels; a label with a comma; drawn from a python3 "
              "without matplotlib; a missing file is refused")

if __name__ == "__main__":
    main()
