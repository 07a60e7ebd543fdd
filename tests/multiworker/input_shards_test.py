"""Per-worker sharding of a file-backed input pipeline is exact: under MultiWorkerMirrored with 1, 2
and 3 workers (dtrain-run, real processes over TCP), each epoch's global batches hold every image
exactly once, the same images in the same order and with the same random flips whatever the number
of workers; and a job resumed mid-epoch (skip to the step, as BackupAndRestore does) yields exactly
the uninterrupted run's remaining steps.

    input_shards_test.py DTRAIN_RUN INPUT_SHARDS
"""
import json, os, subprocess, sys, tempfile

launcher, prog = sys.argv[1], sys.argv[2]
N, B, EPOCHS = 31, 7, 2
tmp = tempfile.mkdtemp(prefix="dtrain_input_shards_")
subprocess.run([prog, "--make", tmp, "-n", str(N)], check=True, timeout=60)


def run(np_, *extra):
    out = subprocess.run([launcher, "-np", str(np_), "--", prog, "--dir", tmp, "--batch", str(B),
                          "--epochs", str(EPOCHS), *extra],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"-np {np_} failed ({out.returncode}):\n{out.stderr[-3000:]}"
    # dtrain-run prefixes each line with its task ("[worker:0] "); only the chief prints steps.
    steps = [json.loads(l[l.index("{"):]) for l in out.stdout.splitlines() if "{" in l]
    assert steps, out.stderr[-2000:]
    return steps


runs = {w: run(w) for w in (1, 2, 3)}
for w, steps in runs.items():
    for e in range(EPOCHS):
        rows = [r for s in steps if s["epoch"] == e for r in s["rows"]]
        assert sorted(rows) == list(range(N)), f"{w} workers, epoch {e}: {sorted(rows)}"
        assert len([s for s in steps if s["epoch"] == e]) == (N + B - 1) // B
    assert steps == runs[1], f"{w} workers differ from 1:\n{steps}\n{runs[1]}"
    print(f"{w} worker(s): {len(steps)} steps, every image once per epoch, same order and flips as 1")
e0 = [r for s in runs[1] if s["epoch"] == 0 for r in s["rows"]]
e1 = [r for s in runs[1] if s["epoch"] == 1 for r in s["rows"]]
assert e0 != e1, "epochs should be shuffled differently"
f0 = [f for s in runs[1] if s["epoch"] == 0 for f in s["flipped"]]
f1 = [f for s in runs[1] if s["epoch"] == 1 for f in s["flipped"]]
assert 0 < sum(f0) < N and f0 != f1, "flips should be random per (epoch, image)"

# Resume at epoch 0, step 2 (and at epoch 1, step 3) under 2 and 3 workers.
for w in (2, 3):
    for epoch, step in ((0, 2), (1, 3)):
        resumed = run(w, "--resume-epoch", str(epoch), "--resume-step", str(step))
        want = [s for s in runs[1] if (s["epoch"], s["step"]) >= (epoch, step)]
        assert resumed == want, f"{w} workers resumed at {epoch}/{step}:\n{resumed}\n{want}"
    print(f"{w} workers: resumed mid-epoch = the uninterrupted run's remaining steps")

# A corrupt image skipped (ignore_errors): its batch is one row shorter, the same batches whatever
# the number of workers. Each worker reads only its replicas' rows of a batch, so the worker whose
# window held it has a row fewer (distribute_dataset ended with Internal there before).
bad = os.path.join(tmp, "class_1", "004.png")
with open(bad, "wb") as f:
    f.write(b"not a png at all")
skipped = {w: run(w, "--ignore-errors") for w in (1, 2, 3)}
for w, steps in skipped.items():
    for e in range(EPOCHS):
        rows = [r for s in steps if s["epoch"] == e for r in s["rows"]]
        assert sorted(rows) == [r for r in range(N) if r != 4], f"{w} workers, epoch {e}: {sorted(rows)}"
        assert len([s for s in steps if s["epoch"] == e]) == (N + B - 1) // B
    assert steps == skipped[1], f"{w} workers differ from 1 with a row skipped:\n{steps}\n{skipped[1]}"
    print(f"{w} worker(s), a corrupt image skipped: every other image once per epoch, the same batches as 1")
r = subprocess.run([launcher, "-np", "2", "--", prog, "--dir", tmp, "--batch", str(B), "--epochs", "1"],
                   capture_output=True, text=True, timeout=120)
assert r.returncode != 0 and "004.png" in r.stderr, r.stderr[-2000:]
print("without ignore_errors the corrupt image ends the job, named")
print("OK")
