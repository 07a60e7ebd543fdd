#include "step_model.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <stdexcept>

#include "bench_util.h"

namespace dtrain::bench {
namespace {

struct Span {
  double begin = 0, end = 0;  // microseconds
};

}  // namespace

double StepProfile::gradient_bytes() const {
  double b = 0;
  for (const auto& g : gradients) b += g.bytes;
  return b;
}

StepProfile StepProfile::scaled(double factor) const {
  StepProfile p = *this;
  p.forward *= factor;
  p.backward *= factor;
  p.update *= factor;
  p.other *= factor;
  for (auto& g : p.gradients) g.at *= factor;
  return p;
}

StepProfile profile_from_timeline(const nlohmann::json& trace, int warmup) {
  const nlohmann::json& events =
      trace.is_object() && trace.contains("traceEvents") ? trace["traceEvents"] : trace;
  if (!events.is_array()) throw std::runtime_error("not a Chrome trace (no event array)");
  // The first process (in file order) with backward spans, and the thread they are on.
  long pid = -1, tid = -1;
  for (const auto& e : events)
    if (e.value("ph", "") == "X" && e.value("name", "") == "backward") {
      pid = e.value("pid", 0L);
      tid = e.value("tid", 0L);
      break;
    }
  if (pid < 0)
    throw std::runtime_error(
        "no \"backward\" span: record the profile with DTRAIN_TIMELINE set, from fit() or "
        "examples/synthetic_benchmark (a step written by hand needs timeline::Span around its "
        "forward, backward and update)");
  std::vector<Span> fwd, back, upd;
  struct Ready {
    double ts;
    long index;
    double bytes;
  };
  std::vector<Ready> ready;
  for (const auto& e : events) {
    if (e.value("ph", "") != "X" || e.value("pid", 0L) != pid) continue;
    const std::string name = e.value("name", "");
    const double ts = e.value("ts", 0.0), dur = e.value("dur", 0.0);
    if (e.value("cat", "") == "gradient") {
      long index = 0;
      double bytes = 0;
      if (std::sscanf(name.c_str(), "gradient %ld: %lf B", &index, &bytes) == 2)
        ready.push_back({ts, index, bytes});
      continue;
    }
    if (e.value("tid", 0L) != tid) continue;
    if (name == "forward") fwd.push_back({ts, ts + dur});
    if (name == "backward") back.push_back({ts, ts + dur});
    if (name == "optimizer update") upd.push_back({ts, ts + dur});
  }
  auto by_begin = [](const Span& a, const Span& b) { return a.begin < b.begin; };
  std::sort(fwd.begin(), fwd.end(), by_begin);
  std::sort(back.begin(), back.end(), by_begin);
  std::sort(upd.begin(), upd.end(), by_begin);
  std::vector<double> f, b, u, o;
  std::map<long, std::vector<double>> at;
  std::map<long, double> bytes;
  int steps = 0;
  for (size_t k = 0; k < back.size(); ++k) {
    if (static_cast<int>(k) < warmup) continue;
    const Span& bk = back[k];
    // This step's forward: the last one that began before backward; its update: the first after.
    const Span* fw = nullptr;
    for (const auto& s : fwd)
      if (s.begin <= bk.begin) fw = &s;
    const Span* up = nullptr;
    for (const auto& s : upd)
      if (s.begin >= bk.end) {
        up = &s;
        break;
      }
    if (!fw || !up) continue;
    // "other": from this update's end to the next step's forward (the last step has none).
    for (const auto& s : fwd)
      if (s.begin >= up->end) {
        o.push_back((s.begin - up->end) / 1e6);
        break;
      }
    f.push_back((fw->end - fw->begin) / 1e6);
    b.push_back((bk.end - bk.begin) / 1e6);
    u.push_back((up->end - up->begin) / 1e6);
    for (const auto& r : ready)
      if (r.ts >= bk.begin && r.ts <= bk.end) {
        at[r.index].push_back((r.ts - bk.begin) / 1e6);
        bytes[r.index] = r.bytes;
      }
    ++steps;
  }
  if (steps == 0)
    throw std::runtime_error("no complete step (forward, backward, optimizer update) after the " +
                             std::to_string(warmup) + " warm-up step(s) of " +
                             std::to_string(back.size()) + ": run more steps or lower --warmup");
  if (at.empty())
    throw std::runtime_error(
        "no \"gradient I: B B\" events inside backward: record the profile under a strategy that "
        "all-reduces as backward runs (mirrored or multi_worker_mirrored with overlap on)");
  StepProfile p;
  p.steps = steps;
  p.forward = median(f);
  p.backward = median(b);
  p.update = median(u);
  p.other = o.empty() ? 0 : median(o);  // only the last step counted: it has no next forward
  for (auto& [index, times] : at) p.gradients.push_back({median(times), bytes[index]});
  std::stable_sort(p.gradients.begin(), p.gradients.end(),
                   [](const GradientReady& x, const GradientReady& y) { return x.at < y.at; });
  return p;
}

Algorithm parse_algorithm(const std::string& name) {
  if (name == "ring") return Algorithm::kRing;
  if (name == "tree") return Algorithm::kTree;
  if (name == "hierarchical") return Algorithm::kHierarchical;
  throw std::invalid_argument("algorithm must be ring, tree or hierarchical, got '" + name + "'");
}

double allreduce_seconds(double bytes, const Network& net) {
  const double n = net.workers;
  if (net.workers <= 1 || bytes <= 0) return 0;
  switch (net.algorithm) {
    case Algorithm::kRing:
      return 2 * (n - 1) * net.alpha + 2 * (n - 1) / n * bytes / net.busbw;
    case Algorithm::kTree:
      return 2 * std::ceil(std::log2(n)) * net.alpha + 2 * (n - 1) / n * bytes / net.busbw;
    case Algorithm::kHierarchical: {
      const double g = std::max(1, net.workers_per_host);
      const double h = std::ceil(n / g);
      double t = 0;
      if (g > 1) t += 2 * (g - 1) * (net.intra_alpha + bytes / g / net.intra_busbw);
      if (h > 1) t += 2 * (h - 1) * net.alpha + 2 * (h - 1) / h * bytes / net.busbw;
      return t;
    }
  }
  return 0;
}

namespace {

// The packs of a step whose backward pass (and every gradient's ready time) is `stretch` times the
// measured one, on one channel in order; *overlapped: the bytes all-reduced while backward runs (a
// pack that straddles its end counted by the share of its time before it).
StepPrediction schedule(const StepProfile& measured, double stretch, const Network& net,
                        double bytes_per_pack, double* overlapped) {
  StepPrediction out;
  out.compute_seconds = measured.compute();
  StepProfile profile = measured;
  profile.backward *= stretch;
  for (auto& g : profile.gradients) g.at *= stretch;
  // Packs as GradientPacker forms them: a pack is launched by the gradient that fills it.
  std::vector<PackTiming> packs;
  PackTiming cur;
  for (const auto& g : profile.gradients) {
    cur.bytes += g.bytes;
    if (cur.bytes >= bytes_per_pack) {
      cur.launch = g.at;
      packs.push_back(cur);
      cur = PackTiming();
    }
  }
  if (cur.bytes > 0) {
    cur.launch = profile.backward;  // the rest, when backward ends
    packs.push_back(cur);
  }
  double channel_free = 0, hidden = 0, last_end = profile.backward;
  *overlapped = 0;
  for (auto& p : packs) {
    p.start = std::max(p.launch, channel_free);
    p.end = p.start + allreduce_seconds(p.bytes, net);
    channel_free = p.end;
    out.allreduce_seconds += p.end - p.start;
    const double inside = std::max(0.0, std::min(p.end, profile.backward) - p.start);
    hidden += inside;
    if (p.end > p.start) *overlapped += p.bytes * inside / (p.end - p.start);
    last_end = std::max(last_end, p.end);
  }
  out.packs = packs;
  out.hidden_share = out.allreduce_seconds > 0 ? hidden / out.allreduce_seconds : 0;
  out.seconds_per_step = profile.forward + last_end + profile.update + profile.other;
  out.efficiency = out.seconds_per_step > 0 ? out.compute_seconds / out.seconds_per_step : 0;
  return out;
}

}  // namespace

StepPrediction simulate_step(const StepProfile& measured, const Network& net,
                             double bytes_per_pack) {
  double overlapped = 0;
  if (net.cpu_seconds_per_byte <= 0 || net.workers <= 1 || measured.backward <= 0)
    return schedule(measured, 1, net, bytes_per_pack, &overlapped);
  // Communication on the compute cores: backward (and when each gradient is ready) stretched by
  // the CPU time of the bytes all-reduced while it runs, for every worker sharing the core. Bytes
  // all-reduced after backward has ended take no compute from it: their time is the channel's
  // (busbw was measured with the CPU to itself). Until 2026-11-29 every byte stretched backward,
  // counting the tail's bytes twice. Which bytes overlap depends on the stretch, so the two are
  // solved together: from the stretch of every byte (an upper bound), the stretch of the bytes
  // that overlap, until it settles (a longer backward overlaps no fewer bytes, so the rounds come
  // down from that bound; they settle in a few, 50 bound them).
  const double n = net.workers;
  const double per_byte =
      std::max(1, net.workers_per_core) * net.cpu_seconds_per_byte * 2 * (n - 1) / n;
  double stretch = 1 + per_byte * measured.gradient_bytes() / measured.backward;
  StepPrediction out = schedule(measured, stretch, net, bytes_per_pack, &overlapped);
  for (int round = 0; round < 50; ++round) {
    const double next = 1 + per_byte * overlapped / measured.backward;
    if (std::abs(next - stretch) <= 1e-12 * stretch) break;
    stretch = next;
    out = schedule(measured, stretch, net, bytes_per_pack, &overlapped);
  }
  return out;
}

}  // namespace dtrain::bench
