#!/bin/sh
# in_memory_budget.sh MB COMMAND...: runs COMMAND in a memory cgroup (v1) of its own limited to MB
# megabytes (memory.limit_in_bytes; the machine has no swap), so that exceeding it kills the process
# (the kernel's OOM killer) instead of slowing it. Needs root. One cgroup per process:
# dtrain-budget-<pid>, left for the caller to remove (bench/zero/budget.py does).
set -e
mb=$1
shift
cg=/sys/fs/cgroup/memory/dtrain-budget-$$
mkdir -p "$cg"
echo $((mb * 1024 * 1024)) > "$cg/memory.limit_in_bytes"
echo $$ > "$cg/cgroup.procs"
exec "$@"
