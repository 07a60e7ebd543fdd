// The cores this process may run on: its affinity mask (a launcher such as dtrain-run or taskset
// may have given it a share of the machine), else std::thread::hardware_concurrency(); at least 1.
// Internal: the CPU devices' default threads, the input pipeline's autotuning and the
// initializers' fill threads read it.
#pragma once

namespace dtrain::detail {

int usable_cores();

}  // namespace dtrain::detail
