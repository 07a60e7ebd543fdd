#!/usr/bin/env python3
"""Where one training step's GPU time goes, from `ncu --csv --metrics gpu__time_duration.sum` of
examples/synthetic_benchmark (bench/gpu/profile.sh writes such a CSV, gzipped or not).

The step is the second: the kernels after the first run of SGD updates up to the end of the
second. Prints the step's kernel count and GPU time, then time by family and by kernel.
  bench/gpu/ncu_summary.py ncu_dtrain_b32.csv[.gz] [--top 25]
"""
import argparse, collections, csv, gzip, re


def main():
    a = argparse.ArgumentParser()
    a.add_argument("csv")
    a.add_argument("--top", type=int, default=25)
    args = a.parse_args()
    opener = gzip.open if args.csv.endswith(".gz") else open
    with opener(args.csv, "rt") as f:
        rows = [r for r in csv.reader(line for line in f if line.startswith('"') and line[1].isdigit())]
    ks = [(r[4], float(r[14].replace(",", ""))) for r in rows]
    sgd = [i for i, (n, _) in enumerate(ks) if "sgd_kernel" in n]
    if not sgd:
        raise SystemExit("no sgd_kernel in the profile: was it a training run with SGD?")
    ends = [sgd[i] for i in range(len(sgd) - 1) if sgd[i + 1] - sgd[i] > 5] + [sgd[-1]]
    if len(ends) < 2:
        raise SystemExit("fewer than two steps in the profile")
    step = ks[ends[0] + 1:ends[1] + 1]
    total = sum(t for _, t in step)
    print(f"step 2: {len(step)} kernels, {total / 1e6:.2f} ms of GPU time")

    def family(n):
        if "dtrain" in n and ("bn_" in n or "reduce" in n):
            return "batch norm (dtrain)"
        if "dtrain" in n:
            return "other dtrain kernels"
        if re.search(r"gemm_f32f32_f32f32_f32_(nn|nt|tn)|cutlass|splitK", n):
            return "cuBLAS SGEMM (1x1 convolutions)"
        if "pooling" in n:
            return "cuDNN pooling"
        if "Nchw" in n or "Nhwc" in n:
            return "cuDNN layout transposes"
        return "cuDNN convolutions"
    fam = collections.Counter()
    for n, t in step:
        fam[family(n)] += t
    for k, v in fam.most_common():
        print(f"  {v / 1e6:7.2f} ms  {k}")
    agg = collections.defaultdict(lambda: [0, 0.0])
    for n, t in step:
        k = re.sub(r"\(.*", "", n).replace("void ", "")[:100]
        agg[k][0] += 1
        agg[k][1] += t
    print(f"top {args.top} kernels:")
    for k, (c, t) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:args.top]:
        print(f"  {t / 1e6:7.2f} ms {c:5d}x  {k}")


if __name__ == "__main__":
    main()
