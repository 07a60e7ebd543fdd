"""PyTorch's matrix products on one thread: GFLOP/s of torch.mm in float32 and bfloat16 on GPT-2
small's shapes (4 windows x 256 tokens: the attention and MLP projections, the tied head) and on
n x n x n squares, the best of 5 products each. Beside `dtrain-bench peak` (oneDNN's), it tells
whether a peer's products run at the core's limit: PyTorch's float32 products go to MKL, its
bfloat16 ones to oneDNN.

    taskset -c 0 build/peers-venv/bin/python bench/peers/torch_mm.py
"""
import time

import torch

torch.set_num_threads(1)
print("torch", torch.__version__)
for line in torch.__config__.show().splitlines():
    if "Math Kernel" in line or "MKL-DNN" in line or "CPU capability" in line:
        print(line.strip())
SHAPES = [(1024, 768, 2304), (1024, 768, 768), (1024, 768, 3072), (1024, 3072, 768),
          (1024, 768, 50257), (1024, 1024, 1024), (2048, 2048, 2048)]
for dtype in (torch.float32, torch.bfloat16):
    for m, k, n in SHAPES:
        a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
        torch.mm(a, b)
        best = float("inf")
        for _ in range(5):
            t = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - t)
        print(f"{str(dtype):15s} {m}x{k}x{n}: {2 * m * k * n / best / 1e9:7.1f} GFLOP/s")
