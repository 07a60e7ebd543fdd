#!/usr/bin/env python3
"""examples/horovod_fashion_mnist started the ways Horovod jobs start: dtrain-run -np 2, dtrain-run -H
localhost:2 (horovodrun's syntax), mpirun -np 2, and srun (two processes with the variables srun
sets). Each must train as a job of 2 ranks. With --equivalence: 2 ranks of 32 images with Adam 5e-4
(scaled by hvd::size() to 1e-3) equal 1 rank of 64 with Adam 1e-3 after an epoch of 50 steps: rank r reads examples r, r+2, ... in order (--no-shuffle), so each step of the two ranks
covers the one rank's batch. The ranks start from different weights (a seed per rank), so this
holds only if BroadcastGlobalVariablesCallback brings rank 0's to rank 1, DistributedOptimizer
averages the gradients and MetricAverageCallback averages the epoch's loss and accuracy.

  horovod_example_test.py DTRAIN_RUN HOROVOD_EXAMPLE FASHION_MNIST [--equivalence | --mpirun]
"""
import json, os, shutil, subprocess, sys

def result(out, what):
    lines = [l.split("] ", 1)[-1] for l in out.splitlines() if '"test_accuracy"' in l]
    if not lines:
        sys.exit(f"{what}: no JSON result:\n{out}")
    return json.loads(lines[-1])

def run(cmd, what, env=None, timeout=600):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if r.returncode != 0:
        sys.exit(f"{what} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    return r.stdout + r.stderr

def check(j, what, min_acc=0.6):
    if j["size"] != 2 or j["global_batch"] != 64 or not j["test_accuracy"] >= min_acc:
        sys.exit(f"{what}: unexpected result {j}")
    print(f"ok: {what}: 2 ranks, test accuracy {j['test_accuracy']:.4f}, {j['images_per_sec']:.0f} images/sec")

def main():
    dtrain_run, example, fashion = sys.argv[1:4]
    quick = ["--epochs=1", "--train-limit=6000", "--json"]
    if "--equivalence" in sys.argv:
        same = ["--epochs=1", "--train-limit=3200", "--warmup-epochs=0", "--no-shuffle", "--json"]
        two = result(run([dtrain_run, "-np", "2", "--", example, "--batch-size=32", "--lr=0.0005"] + same,
                         "hvd -np 2"), "hvd -np 2")
        one = result(run([dtrain_run, "-np", "1", "--", example, "--batch-size=64", "--lr=0.001"] + same,
                         "hvd -np 1"), "hvd -np 1")
        print(f"2 ranks x 32: {two}\n1 rank x 64: {one}")
        if two["steps"] != one["steps"] or two["global_batch"] != one["global_batch"]:
            sys.exit("the two jobs did not run the same steps at the same global batch")
        # Bounds: one process alone moves its final loss by 1e-5 when its thread count changes
        # oneDNN's summation order (measured); a rank left on its own initial weights, gradients
        # summed instead of averaged, or metrics not averaged move it by 1e-2 or more.
        for key, bound in (("final_loss", 1e-4), ("test_loss", 5e-4)):
            rel = abs(two[key] - one[key]) / abs(one[key])
            print(f"{key}: {two[key]:.8f} vs {one[key]:.8f}, relative difference {rel:.2g}")
            if rel > bound:
                sys.exit(f"{key} of 2 ranks is {rel:.2g} away from 1 rank's (bound {bound})")
        if abs(two["test_accuracy"] - one["test_accuracy"]) > 5e-4:  # 5 of 10,000 test images
            sys.exit(f"test accuracy {two['test_accuracy']} vs {one['test_accuracy']}")
        print("ok: 2 ranks equal 1 rank at the same global batch")
        return
    if "--mpirun" in sys.argv:
        return under_mpirun(example, quick)
    check(result(run([dtrain_run, "-np", "2", "--", example] + quick, "dtrain-run -np 2"), "x"), "dtrain-run -np 2")
    check(result(run([dtrain_run, "-H", "localhost:2", "--", example, "--compression=fp16"] + quick,
                     "dtrain-run -H localhost:2"), "x"), "dtrain-run -H localhost:2 --compression=fp16")
    # srun: the variables srun sets for a 2-task step on one node.
    env = dict(os.environ, DTRAIN_JOB_TOKEN="srun-test-token-0123456789")
    procs = []
    for r in range(2):
        e = dict(env, SLURM_PROCID=str(r), SLURM_LOCALID=str(r), SLURM_NODEID="0", SLURM_NTASKS="2",
                 SLURM_STEP_NUM_TASKS="2", SLURM_STEP_NODELIST="127.0.0.1", SLURM_STEP_TASKS_PER_NODE="2")
        # (an address: a minimal system may not resolve "localhost")
        procs.append(subprocess.Popen([example] + quick, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=e))
    outs = [p.communicate(timeout=300)[0] for p in procs]
    if any(p.returncode != 0 for p in procs):
        sys.exit("srun-style start failed:\n" + "\n".join(outs))
    check(result(outs[0], "srun"), "srun (SLURM_PROCID, SLURM_STEP_NODELIST, ...)")


def under_mpirun(example, quick):
    """mpirun -np 2; exits 77 (CTest: Skipped) without OpenMPI or without dtrain's MPI backend."""
    mpirun = shutil.which("mpirun")
    if not mpirun:
        print("skipped: mpirun -np 2 (OpenMPI is not installed)")
        sys.exit(77)
    cmd = [mpirun, "--oversubscribe", "-np", "2"] + (["--allow-run-as-root"] if os.geteuid() == 0 else []) + [example] + quick
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if r.returncode != 0 and "needs dtrain built with OpenMPI" in r.stdout + r.stderr:
        print("skipped: mpirun -np 2 (this dtrain is built without OpenMPI)")
        sys.exit(77)
    if r.returncode != 0:
        sys.exit(f"mpirun -np 2 failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    check(result(r.stdout + r.stderr, "mpirun"), "mpirun -np 2")

if __name__ == "__main__":
    main()
