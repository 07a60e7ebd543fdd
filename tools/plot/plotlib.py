"""What the plot scripts share: finding matplotlib, and splitting per-file labels.

Debian's matplotlib (python3-matplotlib, which setup.sh installs) belongs to /usr/bin/python3. When
the `python3` first on PATH is another interpreter (a pyenv or conda shim, a virtual environment)
that lacks matplotlib, the script runs itself again under /usr/bin/python3 instead of failing.
"""
import os
import sys

SYSTEM_PYTHON = "/usr/bin/python3"


def pyplot(script):
    """matplotlib.pyplot with the Agg backend. Without matplotlib here, re-executes the calling
    script under Debian's python3 when that one has it; otherwise exits naming the package."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        pass
    here = os.path.abspath(sys.executable) if sys.executable else ""
    if (os.path.exists(SYSTEM_PYTHON) and SYSTEM_PYTHON != here
            and not os.environ.get("DTRAIN_PLOT_REEXEC")):
        os.environ["DTRAIN_PLOT_REEXEC"] = "1"  # once: no loop if that python lacks it too
        os.execv(SYSTEM_PYTHON, [SYSTEM_PYTHON, os.path.abspath(sys.argv[0])] + sys.argv[1:])
    sys.exit(f"{os.path.basename(script)} needs matplotlib: apt-get install python3-matplotlib "
             f"(it is imported by {SYSTEM_PYTHON}; this is {sys.executable})")


def per_file(text, files, what="--labels"):
    """One entry per file from `text`: the whole text for one file; otherwise entries separated by
    ';', or by ',' when the text has no ';' (so a label may contain a comma: "a, b;c")."""
    if text is None:
        return None
    if len(files) == 1:
        return [text]
    sep = ";" if ";" in text else ","
    parts = [p.strip() for p in text.split(sep)]
    if len(parts) != len(files):
        sys.exit(f"{what} gave {len(parts)} entries for {len(files)} files; separate them with ';' "
                 f"(or ',' when none contains a comma), one per file, in the files' order")
    return parts
