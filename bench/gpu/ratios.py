#!/usr/bin/env python3
"""dtrain's rows over their PyTorch peers from bench/gpu/run.sh's results.jsonl: one line each,
for the pairs the file has (a lease cut short gives what it reached).
    python3 bench/gpu/ratios.py OUT/results.jsonl"""
import json
import sys

# dtrain row -> PyTorch row it is measured against
PAIRS = {
    "dtrain_resnet50_b32": "torch_resnet50_b32_fp32",
    "dtrain_resnet50_b32_autotune": "torch_resnet50_b32_fp32",
    "dtrain_resnet50_b32_bn2pass": "torch_resnet50_b32_fp32",
    "dtrain_resnet50_b32_keras": "torch_resnet50_b32_fp32",
    "dtrain_resnet50_b32_tf32": "torch_resnet50_b32_tf32",
    "dtrain_resnet50_b32_bf16": "torch_resnet50_b32_bf16",
    "dtrain_resnet50_b32_bf16_nohandoff": "torch_resnet50_b32_bf16",
    "dtrain_resnet50_b32_bf16_before": "torch_resnet50_b32_bf16",
    "dtrain_resnet50_b256": "torch_resnet50_b256_fp32",
    "dtrain_resnet50_b256_tf32": "torch_resnet50_b256_tf32",
    "dtrain_resnet50_b256_bf16": "torch_resnet50_b256_bf16",
    "dtrain_gpt2_c1024_b8": "torch_gpt2_c1024_b8_fp32",
    "dtrain_gpt2_c1024_b8_tf32": "torch_gpt2_c1024_b8_tf32",
    "dtrain_gpt2_c1024_b8_bf16": "torch_gpt2_c1024_b8_bf16",
}


def rate(row):
    for key in ("img_sec_per_device", "tokens_per_sec", "per_sec"):
        if isinstance(row.get(key), (int, float)) and row[key] > 0:
            return row[key]
    return None


def main():
    rows = {}
    with open(sys.argv[1]) as f:
        for line in f:
            line = line.strip()
            if line:
                row = json.loads(line)
                rows[row.get("label", "")] = row
    for mine, peer in PAIRS.items():
        if mine not in rows or peer not in rows:
            continue
        a, b = rate(rows[mine]), rate(rows[peer])
        if a is None or b is None:
            print(f"{mine}: no rate (rc {rows[mine].get('rc')}, peer rc {rows[peer].get('rc')})")
            continue
        print(f"{mine:36s} {a:10.1f} / {peer} {b:10.1f} = {a / b:.3f}x"
              f"  (GPU memory {rows[mine].get('smi_peak_mb', 0):.0f} vs {rows[peer].get('smi_peak_mb', 0):.0f} MB)")


if __name__ == "__main__":
    main()
