#!/usr/bin/env bash
# Builds dtrain under a sanitizer in its own build directory and runs the tests it is meant for:
#   tools/sanitize.sh address   AddressSanitizer + UBSan (build-asan): the unit, training and
#                               multi-process suites (label sanitize: ctest -L sanitize runs both)
#   tools/sanitize.sh thread    ThreadSanitizer (build-tsan): the collectives and the strategies
# Extra arguments go to ctest. Exit status: ctest's. Any report fails the test that printed it
# (ASan and UBSan abort; TSan exits 66), so "clean" means every selected test passed.
set -euo pipefail
kind=${1:-}
shift || true
src=$(cd "$(dirname "$0")/.." && pwd)
case "$kind" in
  address) build=${SANITIZE_BUILD_DIR:-$src/build-asan}
           # The 5-epoch and timing-bound tests are left out: under ASan the code runs 2-3x slower,
           # which says nothing about memory errors. Builds of other projects (header check,
           # consumer, format) are not sanitized code.
           tests=(-LE "acceptance|slow|sanitize|netns|build|gpu"
                  -E "public_headers|consumer_|clang_format|setup_without_apt|bench_scaling") ;;
  thread)  build=${SANITIZE_BUILD_DIR:-$src/build-tsan}
           tests=(-R "^(inproc_collectives_test|tcp_collectives_test|rpc_test|rpc_wire_test|shm_channel_test|strategy_test|mirrored_test|shared_variables_test|sharded_update_test|sharded_parameters_test|hierarchical_collectives_test|contract_test|input_rows_test|training_api_test|elastic_rendezvous_test|hvd_test|hvd_lifecycle_test|stop_agreement_test|ensemble_workers_test)$") ;;
  *) echo "usage: $0 address|thread [ctest arguments]" >&2; exit 2 ;;
esac
if [ ! -f "$build/CMakeCache.txt" ]; then
  cmake -S "$src" -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDTRAIN_SANITIZE="$kind" \
    -DDTRAIN_WITH_CUDA=OFF -DDTRAIN_WITH_MPI=OFF >/dev/null
fi
cmake --build "$build" -j "${JOBS:-$(nproc)}"
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=0:abort_on_error=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1:suppressions=$src/tools/ubsan.supp}
# oneDNN and libgomp are not instrumented; tools/tsan.supp ignores what TSan reports from inside them.
export TSAN_OPTIONS=${TSAN_OPTIONS:-halt_on_error=1:second_deadlock_stack=1:suppressions=$src/tools/tsan.supp}
cd "$build" && ctest --output-on-failure -j "${JOBS:-$(nproc)}" "${tests[@]}" "$@"
