#!/usr/bin/env python3
"""Runs a command and checks its last output line (JSON) or its failure message.

  run_and_check.py --expect 'test_accuracy>=0.90' --expect 'steps==20' -- ./fashion_mnist ...
  run_and_check.py --fail-with 'valid values' -- ./fashion_mnist --strategy=bogus
"""
import argparse, json, operator, re, subprocess, sys

OPS = {">=": operator.ge, "<=": operator.le, "==": operator.eq, ">": operator.gt, "<": operator.lt}

def main():
    p = argparse.ArgumentParser()
    p.add_argument("--expect", action="append", default=[], help="key OP value on the JSON line")
    p.add_argument("--fail-with", help="the command must exit non-zero printing this text")
    p.add_argument("--timeout", type=float, default=1500)
    p.add_argument("cmd", nargs=argparse.REMAINDER)
    a = p.parse_args()
    cmd = a.cmd[1:] if a.cmd and a.cmd[0] == "--" else a.cmd
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
    out = r.stdout + r.stderr
    if a.fail_with is not None:
        if r.returncode == 0:
            sys.exit(f"expected failure, got exit 0:\n{out}")
        if a.fail_with not in out:
            sys.exit(f"failure message lacks {a.fail_with!r}:\n{out}")
        print(f"ok: exit {r.returncode}, message contains {a.fail_with!r}")
        return
    if r.returncode != 0:
        sys.exit(f"exit {r.returncode}:\n{out}")
    last = [l for l in r.stdout.splitlines() if l.strip()][-1]
    result = json.loads(last)
    for e in a.expect:
        m = re.match(r"(\w+)\s*(>=|<=|==|>|<)\s*(.+)", e)
        key, op, val = m.group(1), m.group(2), m.group(3)
        got = result[key]
        want = type(got)(val) if not isinstance(got, str) else val
        if not OPS[op](got, want):
            sys.exit(f"{key}={got} fails {op} {val}\n{last}")
    print("ok:", last)

if __name__ == "__main__":
    main()
