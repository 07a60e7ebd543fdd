#!/usr/bin/env python3
"""fashion_mnist --precision=bf16 (Keras' mixed_bfloat16): after 5 epochs its test accuracy is within
0.5 points of float32's; the JSON names the policy; an unknown precision is refused by name.

  precision_test.py FASHION_MNIST
"""
import json, subprocess, sys

def run(binary, *args):
    r = subprocess.run([binary, "--json", *args], capture_output=True, text=True, timeout=1200)
    if r.returncode != 0:
        sys.exit(f"failed ({r.returncode}): {' '.join(args)}\n{r.stdout}\n{r.stderr}")
    return json.loads([l for l in r.stdout.splitlines() if l.startswith("{")][-1])

def main():
    binary = sys.argv[1]
    bad = subprocess.run([binary, "--precision=fp16", "--steps=1"], capture_output=True, text=True, timeout=60)
    if bad.returncode == 0 or "unknown precision 'fp16'" not in bad.stderr or "bf16" not in bad.stderr:
        sys.exit(f"--precision=fp16 was not refused by name:\n{bad.stdout}\n{bad.stderr}")
    print("ok: --precision=fp16 refused:", bad.stderr.strip().splitlines()[-1])
    f32 = run(binary, "--epochs=5", "--precision=fp32")
    b16 = run(binary, "--epochs=5", "--precision=bf16")
    if f32["precision"] != "float32" or b16["precision"] != "mixed_bfloat16":
        sys.exit(f"the JSON does not name the policy: {f32} / {b16}")
    gap = 100 * abs(b16["test_accuracy"] - f32["test_accuracy"])
    print(f"float32 {f32['test_accuracy']:.4f}, mixed_bfloat16 {b16['test_accuracy']:.4f}: {gap:.2f} points apart")
    if gap > 0.5 or b16["test_accuracy"] < 0.89:
        sys.exit("mixed_bfloat16 is more than 0.5 points from float32 (or below 89%)")

if __name__ == "__main__":
    main()
