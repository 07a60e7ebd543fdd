#!/usr/bin/env python3
"""Prints the logits applications_test.cc expects from dtrain's torchvision-form ResNets.

Needs torchvision (bench/peers/setup.sh installs it: build/peers-venv/bin/python tests/nn/torchvision_logits.py).
torchvision's resnet50(num_classes=10) and resnet18(num_classes=10), every parameter set by a formula
of its torch name and flat index (weight(), below; the test computes the same for dtrain's variables),
run in training mode (batch statistics) on two 64x64 images, input(i) at NCHW flat index i.
"""
import math

import torch
import torchvision


def weight(name, i, fan_in):
    """The value of element i (row-major, torch's layout) of parameter `name`."""
    s = math.sin(0.7 * i + 0.1 * len(name))
    if name.endswith("bn1.weight") or name.endswith("bn2.weight") or name.endswith("bn3.weight") \
            or name.endswith("downsample.1.weight") or name == "bn1.weight":
        return 1.0 + 0.1 * s
    if fan_in == 0:  # biases: BN's beta and the head's
        return 0.1 * s
    return 0.5 * s / math.sqrt(fan_in)


def main():
    torch.set_num_threads(1)
    x = torch.tensor([math.sin(0.013 * i) for i in range(2 * 3 * 64 * 64)],
                     dtype=torch.float32).reshape(2, 3, 64, 64)
    for build in (torchvision.models.resnet50, torchvision.models.resnet18):
        m = build(num_classes=10).train()
        with torch.no_grad():
            for name, p in m.named_parameters():
                fan_in = p[0].numel() if p.dim() > 1 else 0
                flat = torch.tensor([weight(name, i, fan_in) for i in range(p.numel())],
                                    dtype=torch.float64)
                p.copy_(flat.reshape(p.shape).to(torch.float32))
            y = m(x)
        print(build.__name__, ", ".join(f"{v:.6g}f" for v in y.flatten().tolist()))


if __name__ == "__main__":
    main()
