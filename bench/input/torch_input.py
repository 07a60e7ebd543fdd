"""PyTorch's training input pipeline over a folder of JPEGs (DIR/<class>/*.jpg), timed for
`dtrain-bench input`: torchvision ImageFolder (PIL decode) with RandomResizedCrop(224),
RandomHorizontalFlip, ToTensor, Normalize (ImageNet), in a DataLoader with --threads worker
processes (persistent, shuffle, batch 64). Prints one JSON line: images_per_sec (after --warmup
batches), peak_rss_mb (the main process and its workers)."""
import argparse, json, os, time

p = argparse.ArgumentParser()
p.add_argument("--dir", required=True)
p.add_argument("--threads", type=int, default=1)
p.add_argument("--batch-size", type=int, default=64)
p.add_argument("--epochs", type=int, default=2)
p.add_argument("--warmup", type=int, default=5)
a = p.parse_args()
import torch
import torchvision.transforms as T
from torchvision.datasets import ImageFolder

torch.set_num_threads(1)
tf = T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(),
                T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
loader = torch.utils.data.DataLoader(
    ImageFolder(a.dir, transform=tf), batch_size=a.batch_size, shuffle=True,
    num_workers=a.threads, persistent_workers=True, prefetch_factor=2,
    worker_init_fn=lambda _: torch.set_num_threads(1))


def hwm_mb(pid):
    with open(f"/proc/{pid}/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmHWM")) / 1024


def peak_rss_mb():
    # This process and its live DataLoader workers (children), each at its peak.
    me, total = os.getpid(), hwm_mb("self")
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == me:
                    total += hwm_mb(pid)
        except (OSError, ValueError, StopIteration):
            pass
    return total


n, start, seen = 0, None, 0
rss = 0.0
for epoch in range(a.epochs):
    for images, _ in loader:
        seen += 1
        if seen == a.warmup:
            start = time.perf_counter()
        elif seen > a.warmup:
            n += int(images.shape[0])
secs = time.perf_counter() - start
rss = peak_rss_mb()
print(json.dumps({"system": "torch", "images_per_sec": n / secs, "images": n, "peak_rss_mb": rss}))
