// dtrain-ps: a parameter server for ParameterServerStrategy jobs. It reads its task from TF_CONFIG
// (a "ps" task) and the job token from DTRAIN_JOB_TOKEN, serves variables until SIGTERM/SIGINT,
// and exits 0. A training binary started with a ps task does the same; this tool is for hosts
// that should not carry the training program.
//
//   TF_CONFIG='{"cluster": {...}, "task": {"type": "ps", "index": 0}}' DTRAIN_JOB_TOKEN=...
//   dtrain-ps
#include <cstdio>
#include <cstring>

#include "dtrain/cluster/cluster_resolver.h"
#include "dtrain/strategies/parameter_server_strategy.h"

int main(int argc, char** argv) {
  if (argc > 1 && (std::strcmp(argv[1], "-h") == 0 || std::strcmp(argv[1], "--help") == 0)) {
    std::printf(
        "usage: TF_CONFIG=... DTRAIN_JOB_TOKEN=... dtrain-ps\n"
        "Serves the variables of a ParameterServerStrategy job as the ps task named in TF_CONFIG,\n"
        "until SIGTERM or SIGINT.\n");
    return 0;
  }
  if (argc > 1) {
    std::fprintf(
        stderr,
        "dtrain-ps takes no arguments (got '%s'); the task comes from TF_CONFIG. See --help\n",
        argv[1]);
    return 2;
  }
  try {
    auto cluster = dtrain::from_environment();
    if (!cluster) {
      std::fprintf(stderr,
                   "error: TF_CONFIG is not set; dtrain-ps needs a ps task, e.g. "
                   "{\"cluster\": {\"worker\": [\"h0:2222\"], \"ps\": [\"h1:2222\"]}, \"task\": "
                   "{\"type\": \"ps\", \"index\": 0}}\n");
      return 1;
    }
    dtrain::serve_parameter_server(*cluster);
  } catch (const dtrain::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
