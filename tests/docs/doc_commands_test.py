#!/usr/bin/env python3
"""Runs the shell commands that README.md and docs/*.md show, as a user would type them.

  doc_commands_test.py SOURCE_DIR BUILD_DIR [--no-mpi] [--list]

Every ```sh block is run, or skipped for a reason that is printed: an HTML comment on the line before
the block, `<!-- doc-test: skip: REASON -->`, skips it whole; a command whose program is not installed
here (srun, kubectl) or that starts a server (tensorboard) is skipped alone. A block runs as one bash
script (`set -e`, in order, so its variables and exports carry) in a scratch directory where `build/`,
`tools/`, `bench/`, `src/` and `include/` point at the real ones. Changed on purpose, and only these:
a training command (fashion_mnist, horovod_fashion_mnist) without --steps gets `--steps=20`, which
replaces its epochs; `/tmp/` paths point into the scratch directory; `--devices=gpu` commands are skipped
without a GPU, and mpirun commands when dtrain is built without its MPI backend (--no-mpi). A block
that exits 77 (dtrain-netns where namespaces cannot be made) is skipped. The
test fails naming each block that exits non-zero otherwise, with its output.
"""
import os, re, shlex, shutil, subprocess, sys, tempfile, time

SRC, BUILD = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
TRAINER = re.compile(r"(examples/(fashion_mnist|horovod_fashion_mnist)|\$F)( |$)")
NOT_RUN = {"tensorboard": "a server that runs until stopped (tensorboard_events_test uses its reader)"}


def blocks(path):
    """(line number, skip reason or None, [commands]) of each sh block; a trailing backslash joins
    lines; comments and blank lines are dropped."""
    lines = open(path).read().splitlines()
    out, i = [], 0
    while i < len(lines):
        if lines[i].strip() in ("```sh", "```bash"):
            m = re.match(r"<!-- doc-test: skip: (.+?) -->", lines[i - 1].strip()) if i > 0 else None
            start, body = i + 1, []
            i += 1
            while i < len(lines) and not lines[i].startswith("```"):
                body.append(lines[i])
                i += 1
            cmds, cur = [], ""
            for l in body:
                cur += l.rstrip()
                if cur.endswith("\\"):
                    cur = cur[:-1].rstrip() + " "
                    continue
                if cur.strip() and not cur.strip().startswith("#"):
                    cmds.append(strip_comment(cur.strip()))
                cur = ""
            out.append((start, m.group(1) if m else None, cmds))
        i += 1
    return out


def strip_comment(cmd):
    """The command without a trailing `# comment` outside quotes."""
    quote = None
    for k, ch in enumerate(cmd):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and k > 0 and cmd[k - 1] == " ":
            return cmd[:k].rstrip()
    return cmd


def program(cmd):
    """The program a command line runs (after VAR=value prefixes)."""
    try:
        words = shlex.split(cmd)
    except ValueError:
        words = cmd.split()
    for word in words:
        if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", word):
            return word
    return ""


def rewrite(cmd, scratch, gpu):
    """(command as run, or None) and why it is not run."""
    prog = program(cmd)
    if prog in NOT_RUN:
        return None, NOT_RUN[prog]
    if prog and not prog.startswith(("$", "build/", "tools/", "bench/", "./", "cd")) and not shutil.which(prog) \
            and prog not in ("export", "set", "trap", "wait"):
        return None, f"{prog} is not installed here"
    if "--devices=gpu" in cmd and not gpu:
        return None, "no GPU here"
    if prog == "mpirun" and "--no-mpi" in sys.argv:
        return None, "this dtrain is built without its MPI backend"
    if TRAINER.search(cmd) and "--steps" not in cmd and "--eval-only" not in cmd and not re.match(r"^\w+=\S+$", cmd):
        cmd = cmd[:-1].rstrip() + " --steps=20 &" if cmd.endswith("&") else cmd + " --steps=20"
    return cmd.replace("/tmp/", scratch + "/tmp/"), None


def main():
    files = [os.path.join(SRC, "README.md")] + sorted(
        os.path.join(SRC, "docs", f) for f in os.listdir(os.path.join(SRC, "docs")) if f.endswith(".md"))
    gpu = os.path.exists("/dev/nvidia0")
    failures, skipped, ran = [], [], 0
    with tempfile.TemporaryDirectory(prefix="dtrain-doc-") as scratch:
        os.mkdir(os.path.join(scratch, "tmp"))
        for name in ("build", "tools", "bench", "src", "include"):
            os.symlink(BUILD if name == "build" else os.path.join(SRC, name), os.path.join(scratch, name))
        env = dict(os.environ, DTRAIN_LOG_LEVEL="WARNING", OMPI_ALLOW_RUN_AS_ROOT="1",
                   OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        for path in files:
            rel = os.path.relpath(path, SRC)
            for line, reason, cmds in blocks(path):
                where = f"{rel}:{line}"
                if reason:
                    skipped.append(f"{where} (block): {reason}")
                    continue
                script = ["set -eo pipefail"]
                if any("dtrain-netns up" in c for c in cmds):
                    if os.geteuid() != 0:
                        skipped.append(f"{where} (block): network namespaces need root")
                        continue
                    script.append("trap 'tools/netns/dtrain-netns down >/dev/null 2>&1 || true' EXIT")
                for cmd in cmds:
                    run, why = rewrite(cmd, scratch, gpu)
                    if run is None:
                        skipped.append(f"{where}: {cmd}: {why}")
                        continue
                    if "dtrain-netns up" in run:  # exits 77 where namespaces cannot be made
                        run += " || exit $?"
                    script += [f"echo '+ {run.replace(chr(39), chr(39) + chr(92) + chr(39) + chr(39))}'", run]
                if "--list" in sys.argv:
                    print(f"== {where}\n" + "\n".join(script[1:]))
                    continue
                t0 = time.time()
                r = subprocess.run(["bash", "-c", "\n".join(script)], cwd=scratch, env=env,
                                   capture_output=True, text=True, timeout=900)
                if r.returncode == 77:
                    skipped.append(f"{where} (block): a command said it cannot run here (exit 77): "
                                   f"{(r.stdout + r.stderr).strip().splitlines()[-1:]}")
                    continue
                ran += 1
                print(f"{'ok' if r.returncode == 0 else 'FAILED':>6} {time.time() - t0:6.1f} s  {where} "
                      f"({len(cmds)} commands)")
                if r.returncode != 0:
                    failures.append(f"{where} exited {r.returncode}:\n{r.stdout[-2500:]}\n{r.stderr[-2500:]}")
    if "--list" in sys.argv:
        return
    print(f"\n{ran} blocks run; skipped:")
    for s in skipped:
        print("  " + s)
    if failures:
        sys.exit("\nFAILED:\n" + "\n\n".join(failures))
    if ran == 0:
        sys.exit("no block ran: a test of nothing (are README.md and docs/ where they should be?)")
    print("ok: every command shown ran")


if __name__ == "__main__":
    main()
