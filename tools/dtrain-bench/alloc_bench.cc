// dtrain-bench alloc-replay: an allocation trace (DTRAIN_ALLOC_TRACE=FILE of a training run on one
// device) replayed against the CUDA allocator's policies, without a GPU: how much device memory
// each would have reserved for the same requests in the same order, against the bytes in use at
// the peak (the least any policy needs):
//   - size buckets, the CUDA allocator until 2026-11-27: requests rounded up to one of four sizes
//     per power of two (512 bytes below 1 MiB), a freed block serving only its own bucket;
//   - PyTorch's policy (SegmentCache::Policy::kPyTorch), this allocator's first version;
//   - segments and regions, best fit, the CUDA allocator now (detail::SegmentCache,
//     src/core/free_blocks.h), with a device that has room for every region.
// Device allocations counts the cudaMalloc calls each would make (slow calls, in the first steps).
// The trace comes from the CPU device's kernels: a GPU run asks for the same tensors of the model
// and the tape, but its own kernels' temporaries (cuDNN workspaces, for one) are not in it.
#include <algorithm>
#include <bit>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <unordered_map>

#include "bench_util.h"
#include "core/free_blocks.h"
#include "dtrain/core/error.h"

namespace dtrain::bench {
namespace {

struct Event {
  bool alloc;
  uint64_t address;
  size_t bytes;  // allocations only
};

std::vector<Event> read_trace(const std::string& path) {
  std::ifstream in(path);
  if (!in)
    throw InvalidArgument("alloc-replay: cannot read the trace '" + path +
                          "' (write one with DTRAIN_ALLOC_TRACE=FILE)");
  std::vector<Event> events;
  std::string line;
  for (size_t number = 1; std::getline(in, line); ++number) {
    std::istringstream s(line);
    std::string op, address;
    Event e{};
    s >> op >> address;
    bool ok = (op == "+" || op == "-") && !address.empty();
    if (ok) {
      e.alloc = op == "+";
      try {
        size_t used = 0;
        e.address = std::stoull(address, &used, 16);
        ok = used == address.size();
      } catch (const std::exception&) {
        ok = false;
      }
    }
    if (ok && e.alloc) ok = static_cast<bool>(s >> e.bytes);
    std::string rest;
    if (!ok || (s >> rest))
      throw InvalidArgument(detail::str_cat("alloc-replay: ", path, " line ", number, ": '", line,
                                            "' is not '+ ADDRESS BYTES' or '- ADDRESS' (a trace "
                                            "written by DTRAIN_ALLOC_TRACE)"));
    events.push_back(e);
  }
  return events;
}

// The CUDA allocator's bucket size until 2026-11-27.
size_t bucket_size(size_t nbytes) {
  constexpr size_t kSmall = size_t{1} << 20;
  if (nbytes == 0) nbytes = 1;
  if (nbytes <= kSmall) return (nbytes + 511) & ~size_t{511};
  const int msb = std::bit_width(nbytes - 1) - 1;
  const size_t step = (size_t{1} << msb) / 4;
  return (nbytes + step - 1) / step * step;
}

struct Result {
  const char* name;
  size_t reserved = 0;
  size_t device_allocations = 0;
  size_t last_device_allocation = 0;  // the event, 1-based; 0: none
};

}  // namespace

int alloc_replay_bench(const AllocReplayArgs& a) {
  const std::vector<Event> events = read_trace(a.trace);
  using Seg = detail::SegmentCache;
  // Blocks in use, by address: the request's bytes, its bucket, its segment block.
  struct Live {
    size_t bytes, bucket;
    Seg::Block block, torch_block;
  };
  std::unordered_map<uint64_t, Live> live;
  size_t in_use = 0, peak_in_use = 0, allocations = 0;
  std::unordered_map<size_t, size_t> bucket_free;  // bucket size -> free blocks
  Result buckets{"size buckets (CUDA allocator until 2026-11-27)"};
  Result torch{"PyTorch's policy (2/20 MiB, then exact segments)"};
  Result segments{"regions, best fit (CUDA allocator now)"};
  Seg cache, torch_cache(Seg::Policy::kPyTorch);
  uintptr_t next = uintptr_t{1} << 40;  // fake device addresses, never dereferenced
  // take(), and on a miss a new segment at a fake address apart from the others.
  auto take = [&](Seg& c, Result& r, size_t bytes, size_t event) {
    Seg::Block b = c.take(bytes);
    if (!b.ptr) {
      const size_t size = c.segment_size(bytes);
      c.add_segment(reinterpret_cast<void*>(next), size, bytes);
      next += size + Seg::kSegmentGranularity;  // apart, as separate cudaMallocs may not be
      ++r.device_allocations;
      r.last_device_allocation = event;
      b = c.take(bytes);
    }
    return b;
  };
  for (size_t i = 0; i < events.size(); ++i) {
    const Event& e = events[i];
    if (e.alloc) {
      ++allocations;
      Live l{e.bytes, bucket_size(e.bytes), {}, {}};
      if (size_t& n = bucket_free[l.bucket]; n > 0) {
        --n;
      } else {
        buckets.reserved += l.bucket;
        ++buckets.device_allocations;
        buckets.last_device_allocation = i + 1;
      }
      l.block = take(cache, segments, e.bytes, i + 1);
      l.torch_block = take(torch_cache, torch, e.bytes, i + 1);
      in_use += Seg::round(e.bytes);
      peak_in_use = std::max(peak_in_use, in_use);
      if (!live.emplace(e.address, l).second)
        throw InvalidArgument(detail::str_cat("alloc-replay: event ", i + 1, " allocates ",
                                              std::hex, e.address,
                                              ", which is in use: the trace mixes two processes"));
    } else {
      auto it = live.find(e.address);
      if (it == live.end())
        throw InvalidArgument(detail::str_cat("alloc-replay: event ", i + 1, " releases ", std::hex,
                                              e.address,
                                              ", which was never allocated: a truncated trace?"));
      ++bucket_free[it->second.bucket];
      cache.put(it->second.block.ptr, it->second.block.size);
      torch_cache.put(it->second.torch_block.ptr, it->second.torch_block.size);
      in_use -= Seg::round(it->second.bytes);
      live.erase(it);
    }
  }
  segments.reserved = cache.peak_reserved();
  torch.reserved = torch_cache.peak_reserved();
  const double mb = 1e6;
  std::printf("%s: %zu allocations, %zu events; in use at the peak %.1f MB\n", a.trace.c_str(),
              allocations, events.size(), peak_in_use / mb);
  std::printf("%-48s %12s %9s %19s %10s\n", "policy", "reserved MB", "x in use",
              "device allocations", "the last");
  std::printf("%-48s %12.1f %9.3f %19s %10s\n", "blocks in use at the peak (the least possible)",
              peak_in_use / mb, 1.0, "-", "-");
  for (const Result* r : {&buckets, &torch, &segments})
    std::printf("%-48s %12.1f %9.3f %19zu %9.0f%%\n", r->name, r->reserved / mb,
                peak_in_use ? static_cast<double>(r->reserved) / peak_in_use : 0.0,
                r->device_allocations,
                100.0 * static_cast<double>(r->last_device_allocation) /
                    static_cast<double>(std::max<size_t>(events.size(), 1)));
  std::printf(
      "the last: how far into the trace the last device allocation came (a run whose later "
      "steps allocate nothing new has reached its steady state)\n");
  if (a.json) {
    const nlohmann::json j = {{"benchmark", "alloc_replay"},
                              {"trace", a.trace},
                              {"allocations", allocations},
                              {"peak_in_use_bytes", peak_in_use},
                              {"buckets_reserved_bytes", buckets.reserved},
                              {"buckets_device_allocations", buckets.device_allocations},
                              {"pytorch_policy_reserved_bytes", torch.reserved},
                              {"pytorch_policy_device_allocations", torch.device_allocations},
                              {"segments_reserved_bytes", segments.reserved},
                              {"segments_device_allocations", segments.device_allocations}};
    std::printf("%s\n", j.dump().c_str());
  }
  return 0;
}

}  // namespace dtrain::bench
