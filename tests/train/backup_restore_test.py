#!/usr/bin/env python3
"""BackupAndRestore with real processes: kill -9 a worker of a `dtrain-run -np 3` MultiWorkerMirrored
job (or the whole process of a Mirrored run) mid-epoch, run the same command again, and compare the
final weights, optimizer slots and iteration count with an uninterrupted run: bit for bit.
Also `dtrain-run --max-restarts 2`: one command survives a worker killed twice; a subclassed model
(residual_cnn) in the Mirrored case; and a functional ResNet (resnet8, synchronized batch norm, augmented
batches) under 2 workers, a worker killed mid-epoch.

  backup_restore_test.py DTRAIN_RUN FASHION_MNIST
"""
import json, os, random, signal, struct, subprocess, sys, tempfile, time

def tensors(path):
    """name -> (dtype, shape, raw bytes) of a safetensors file."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    header.pop("__metadata__", None)
    return {k: (v["dtype"], v["shape"], data[v["data_offsets"][0]:v["data_offsets"][1]]) for k, v in header.items()}

def same(a, b, what):
    ta, tb = tensors(a), tensors(b)
    if ta.keys() != tb.keys():
        sys.exit(f"{what}: different tensors: {sorted(ta.keys() ^ tb.keys())}")
    diff = [k for k in ta if ta[k] != tb[k]]
    if diff:
        sys.exit(f"{what}: {len(diff)} of {len(ta)} tensors differ from the uninterrupted run, e.g. {diff[:3]}")
    print(f"ok: {what}: all {len(ta)} tensors (weights, Adam slots, iteration count) bitwise equal")

def backup_step(backup_dir):
    try:
        with open(os.path.join(backup_dir, "checkpoint")) as f:
            return json.load(f)["step"]
    except (OSError, ValueError, KeyError):
        return -1

def run(cmd, timeout=300):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    return r.returncode, r.stdout + r.stderr

def start_and_kill(cmd, backup_dir, victim, min_steps, total_steps):
    """Starts cmd; for each m in min_steps, waits for a backup at >= m and kill -9s victim(proc).
    Returns (status, output)."""
    if isinstance(min_steps, int):
        min_steps = [min_steps]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 240
    for min_step in min_steps:
        while backup_step(backup_dir) < min_step:
            if p.poll() is not None:
                sys.exit(f"the job ended (status {p.returncode}) before a backup at step {min_step}:\n{p.stdout.read()}")
            if time.time() > deadline:
                p.kill()
                sys.exit("no backup appeared within 240 s")
            time.sleep(0.02)
        step = backup_step(backup_dir)
        if step >= total_steps:
            p.kill()
            sys.exit(f"the job finished before it could be killed (backup at step {step}); give it more steps")
        pid = victim(p)
        os.kill(pid, signal.SIGKILL)
        print(f"killed pid {pid} after the backup at step {step}")
    out, _ = p.communicate(timeout=120)
    print(f"the job exited {p.returncode}")
    return p.returncode, out

def children(pid):
    r = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    return [int(x) for x in r.stdout.split()]

def main():
    dtrain_run, binary = sys.argv[1], sys.argv[2]
    rng = random.Random(int(os.environ.get("DTRAIN_TEST_SEED", "7")))
    # 2 epochs of 30 steps; a backup every 5 steps and at each epoch end.
    common = ["--train-limit=2880", "--batch-size=96", "--epochs=2", "--no-eval", "--seed=5", "--backup-every=5"]
    total = 60
    with tempfile.TemporaryDirectory() as d:
        # --- MultiWorkerMirrored, 3 workers ---
        mwms = [dtrain_run, "-np", "3", "--grace", "2", "--", binary, "--strategy=multi_worker_mirrored"] + common
        code, out = run(mwms + ["--checkpoint-dir", f"{d}/ref"])
        if code != 0:
            sys.exit(f"uninterrupted run failed ({code}):\n{out}")
        cmd = mwms + ["--backup-dir", f"{d}/bk", "--checkpoint-dir", f"{d}/k"]
        code, out = start_and_kill(cmd, f"{d}/bk", lambda p: rng.choice(children(p.pid)), 10, total)
        if code == 0:
            sys.exit(f"the job survived a killed worker without --max-restarts:\n{out}")
        code, out = run(cmd)
        if code != 0 or "resuming from a backup" not in out:
            sys.exit(f"the second run did not resume ({code}):\n{out}")
        same(f"{d}/ref/final.safetensors", f"{d}/k/final.safetensors", "MWMS x3, a worker killed, run again")
        if os.path.exists(f"{d}/bk/checkpoint"):
            sys.exit("the backup was not deleted after training finished")

        # --- the same with dtrain-run --max-restarts 2: one command, a worker killed twice ---
        cmd = [dtrain_run, "-np", "3", "--grace", "2", "--max-restarts", "2", "--", binary,
               "--strategy=multi_worker_mirrored"] + common + ["--backup-dir", f"{d}/bk2", "--checkpoint-dir", f"{d}/k2"]
        code, out = start_and_kill(cmd, f"{d}/bk2", lambda p: rng.choice(children(p.pid)), [10, 30], total)
        if code != 0 or out.count("relaunching all of it") != 2 or out.count("resuming from a backup") != 2:
            sys.exit(f"--max-restarts 2 did not carry the job through two kills ({code}):\n{out}")
        same(f"{d}/ref/final.safetensors", f"{d}/k2/final.safetensors", "MWMS x3 under --max-restarts 2, 2 kills")

        # --- Mirrored on two logical CPUs, the whole process killed: the reference CNN, and a
        # subclassed model with synchronized batch normalization. (With per-replica statistics each
        # replica's moving mean is its own, and a checkpoint holds their mean, as TF saves a
        # sync-on-read variable: a resumed run starts every replica from that mean, so its final
        # mean equals the uninterrupted one only up to float rounding.) ---
        for model in ("reference_cnn", "residual_cnn"):
            mirrored = [binary, "--strategy=mirrored", "--devices=cpu:2", f"--model={model}", "--sync-bn"] + common
            code, out = run(mirrored + ["--checkpoint-dir", f"{d}/mref-{model}"])
            if code != 0:
                sys.exit(f"uninterrupted mirrored run of {model} failed ({code}):\n{out}")
            cmd = mirrored + ["--backup-dir", f"{d}/mbk-{model}", "--checkpoint-dir", f"{d}/mk-{model}"]
            code, out = start_and_kill(cmd, f"{d}/mbk-{model}", lambda p: p.pid, 35, total)  # in the second epoch
            if code != -signal.SIGKILL:
                sys.exit(f"expected the process to die of SIGKILL, got {code}")
            code, out = run(cmd)
            if code != 0 or "resuming from a backup" not in out:
                sys.exit(f"the mirrored rerun of {model} did not resume ({code}):\n{out}")
            same(f"{d}/mref-{model}/final.safetensors", f"{d}/mk-{model}/final.safetensors",
                 f"{model}, Mirrored cpu:2, process killed, run again")

        # --- a functional ResNet (synchronized batch norm, augmented batches), MWMS x2, a worker killed ---
        resnet = [dtrain_run, "-np", "2", "--grace", "2", "--", binary, "--strategy=multi_worker_mirrored",
                  "--model=resnet8", "--sync-bn", "--augment"] + common
        code, out = run(resnet + ["--checkpoint-dir", f"{d}/rref"])
        if code != 0:
            sys.exit(f"uninterrupted resnet8 run failed ({code}):\n{out}")
        cmd = resnet + ["--backup-dir", f"{d}/rbk", "--checkpoint-dir", f"{d}/rk"]
        code, out = start_and_kill(cmd, f"{d}/rbk", lambda p: rng.choice(children(p.pid)), 35, total)
        if code == 0:
            sys.exit(f"the resnet8 job survived a killed worker without --max-restarts:\n{out}")
        code, out = run(cmd)
        if code != 0 or "resuming from a backup" not in out:
            sys.exit(f"the resnet8 rerun did not resume ({code}):\n{out}")
        same(f"{d}/rref/final.safetensors", f"{d}/rk/final.safetensors",
             "functional resnet8 (sync BN, augmentation), MWMS x2, a worker killed, run again")

if __name__ == "__main__":
    main()
