#!/usr/bin/env python3
"""Includes point one way: each folder of src/ and include/dtrain/ may include only the folders
below it (docs/architecture.md draws the picture).

    layering_check.py SOURCE_DIR

Fails naming every file that includes a folder above its own, the include, and what the folder may
include. The lower half (core, devices, model: tensors, ops, GradientTape, variables and their
creator stack, initializers, update rules) knows no strategy.
"""
import pathlib
import re
import sys

# folder -> the folders it may include (itself included).
ALLOWED = {
    "core": {"core"},
    "devices": {"core", "devices"},
    "model": {"core", "devices", "model"},
    "data": {"core", "devices", "data"},
    "cluster": {"core", "cluster"},
    "collectives": {"core", "devices", "collectives"},
    "strategies": {"core", "devices", "model", "data", "cluster", "collectives", "strategies"},
    "nn": {"core", "devices", "model", "data", "strategies", "nn"},
    "train": {"core", "devices", "model", "data", "cluster", "collectives", "strategies", "nn",
              "train"},
    "horovod": {"core", "devices", "model", "data", "cluster", "collectives", "strategies", "nn",
                "train", "horovod"},
}
INCLUDE = re.compile(r'^\s*#\s*include\s+"(?:dtrain/)?([a-z_]+)/')


def main():
    root = pathlib.Path(sys.argv[1])
    bad, checked = [], 0
    for base in (root / "src", root / "include" / "dtrain"):
        for folder, allowed in ALLOWED.items():
            for path in sorted((base / folder).rglob("*")):
                if path.suffix not in (".h", ".cc", ".cu", ".cuh"):
                    continue
                checked += 1
                for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                    m = INCLUDE.match(line)
                    if m and m.group(1) in ALLOWED and m.group(1) not in allowed:
                        bad.append(f"  {path.relative_to(root)}:{n}: {line.strip()}  "
                                   f"({folder}/ may include {', '.join(sorted(allowed))})")
    print(f"checked the includes of {checked} files")
    if checked == 0:
        print("no source files found under", root)
        return 1
    if bad:
        print(f"{len(bad)} includes point upwards:")
        print("\n".join(bad))
        print("move the code to the folder that may see both, or pass what it needs in from above")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
