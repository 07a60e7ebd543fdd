// The step model behind `dtrain-bench simulate` (tools/dtrain-bench/step_model.h): all-reduce costs
// against their closed forms, pack formation and the FIFO channel against hand-worked timelines,
// and the profile read back from a timeline; and the hypervisor's steal as `compare` reports it.
#include "step_model.h"

#include <gtest/gtest.h>

#include <cmath>
#include <stdexcept>
#include <string>

#include "bench_util.h"

namespace dtrain::bench {
namespace {

constexpr double kMB = 1e6;

Network ring(int workers, double busbw, double alpha = 0) {
  Network n;
  n.workers = workers;
  n.busbw = busbw;
  n.alpha = alpha;
  return n;
}

TEST(StepModelTest, RingAllReduceMatchesItsClosedForm) {
  EXPECT_EQ(allreduce_seconds(100 * kMB, ring(1, 100 * kMB)), 0);           // nobody to talk to
  EXPECT_DOUBLE_EQ(allreduce_seconds(100 * kMB, ring(2, 100 * kMB)), 1.0);  // 2 (N-1)/N = 1
  EXPECT_DOUBLE_EQ(allreduce_seconds(100 * kMB, ring(4, 100 * kMB)), 1.5);
  // Latency: 2 (N-1) ring steps.
  EXPECT_DOUBLE_EQ(allreduce_seconds(100 * kMB, ring(4, 100 * kMB, 0.01)), 1.5 + 0.06);
  EXPECT_NEAR(allreduce_seconds(0.0, ring(1024, 1e9, 1e-5)), 0, 0);
  EXPECT_NEAR(allreduce_seconds(1.0, ring(1024, 1e12, 1e-5)), 2 * 1023 * 1e-5, 1e-9);
}

TEST(StepModelTest, TreeHasLogarithmicLatencyAndTheRingsBandwidth) {
  Network t = ring(1024, 1e12, 1e-5);
  t.algorithm = Algorithm::kTree;
  EXPECT_NEAR(allreduce_seconds(1.0, t), 2 * 10 * 1e-5, 1e-9);  // ceil(log2 1024) = 10
  t.alpha = 0;
  EXPECT_DOUBLE_EQ(allreduce_seconds(1e9, t), allreduce_seconds(1e9, ring(1024, 1e12)));
  t.workers = 5;  // ceil(log2 5) = 3
  t.alpha = 1;
  EXPECT_NEAR(allreduce_seconds(1e-9, t), 6, 1e-6);
}

TEST(StepModelTest, HierarchicalAddsTheHostStagesToARingOverHosts) {
  Network h;
  h.algorithm = Algorithm::kHierarchical;
  h.workers = 32;
  h.workers_per_host = 8;  // 4 hosts
  h.busbw = 100 * kMB;
  h.intra_busbw = 800 * kMB;
  h.alpha = 0.001;
  h.intra_alpha = 0.0001;
  const double s = 80 * kMB;
  const double intra = 2 * 7 * (0.0001 + s / 8 / (800 * kMB));  // reduce-scatter + all-gather
  const double inter = 2 * 3 * 0.001 + 2.0 * 3 / 4 * s / (100 * kMB);
  EXPECT_NEAR(allreduce_seconds(s, h), intra + inter, 1e-12);
  h.workers = 8;  // one host: no link crossed
  EXPECT_NEAR(allreduce_seconds(s, h), intra, 1e-12);
  EXPECT_EQ(parse_algorithm("hierarchical"), Algorithm::kHierarchical);
  EXPECT_THROW(parse_algorithm("butterfly"), std::invalid_argument);
}

StepProfile three_gradients() {
  StepProfile p;
  p.forward = 1;
  p.backward = 2;
  p.update = 0.5;
  p.other = 0.1;
  p.gradients = {{0.5, 4 * kMB}, {1.0, 4 * kMB}, {2.0, 2 * kMB}};
  return p;
}

TEST(StepModelTest, PacksOverlapBackwardWhenTheLinkKeepsUp) {
  // A 4 MB pack takes 0.25 s: packs 1 and 2 run inside backward, the last (2 MB) after it.
  const StepPrediction p = simulate_step(three_gradients(), ring(2, 16 * kMB), 4 * kMB);
  ASSERT_EQ(p.packs.size(), 3u);
  EXPECT_DOUBLE_EQ(p.packs[0].start, 0.5);
  EXPECT_DOUBLE_EQ(p.packs[0].end, 0.75);
  EXPECT_DOUBLE_EQ(p.packs[1].start, 1.0);
  EXPECT_DOUBLE_EQ(p.packs[2].launch, 2.0);  // the partly filled pack: when backward ends
  EXPECT_DOUBLE_EQ(p.packs[2].end, 2.125);
  EXPECT_DOUBLE_EQ(p.compute_seconds, 3.6);
  EXPECT_DOUBLE_EQ(p.seconds_per_step, 1 + 2.125 + 0.5 + 0.1);
  EXPECT_DOUBLE_EQ(p.allreduce_seconds, 0.625);
  EXPECT_DOUBLE_EQ(p.hidden_share, 0.5 / 0.625);
  EXPECT_DOUBLE_EQ(p.efficiency, 3.6 / 3.725);
}

TEST(StepModelTest, PacksQueueOnOneChannelWhenTheLinkIsSlow) {
  // 4 MB take 1 s: pack 2 waits for pack 1, the last waits for pack 2.
  const StepPrediction p = simulate_step(three_gradients(), ring(2, 4 * kMB), 4 * kMB);
  ASSERT_EQ(p.packs.size(), 3u);
  EXPECT_DOUBLE_EQ(p.packs[1].launch, 1.0);
  EXPECT_DOUBLE_EQ(p.packs[1].start, 1.5);
  EXPECT_DOUBLE_EQ(p.packs[2].start, 2.5);
  EXPECT_DOUBLE_EQ(p.packs[2].end, 3.0);
  EXPECT_DOUBLE_EQ(p.seconds_per_step, 1 + 3.0 + 0.5 + 0.1);
  EXPECT_DOUBLE_EQ(p.hidden_share, 1.5 / 2.5);  // pack 1 whole, pack 2 from 1.5 to 2.0
}

TEST(StepModelTest, PacksFormAsTheGradientPackerFormsThem) {
  // A pack is launched by the gradient that fills it (bytes >= pack size), so a large gradient
  // closes the pack it joins; one pack of everything when the pack is larger than the model.
  StepProfile prof = three_gradients();
  prof.gradients = {{0.1, 1 * kMB}, {0.2, 9 * kMB}, {0.3, 1 * kMB}, {0.4, 1 * kMB}};
  const StepPrediction small = simulate_step(prof, ring(2, 1e12), 4 * kMB);
  ASSERT_EQ(small.packs.size(), 2u);
  EXPECT_DOUBLE_EQ(small.packs[0].bytes, 10 * kMB);
  EXPECT_DOUBLE_EQ(small.packs[0].launch, 0.2);
  EXPECT_DOUBLE_EQ(small.packs[1].bytes, 2 * kMB);
  EXPECT_DOUBLE_EQ(small.packs[1].launch, prof.backward);
  const StepPrediction one = simulate_step(prof, ring(2, 1e12), 1000 * kMB);
  ASSERT_EQ(one.packs.size(), 1u);
  EXPECT_DOUBLE_EQ(one.hidden_share, 0);  // nothing left to overlap with
  // One worker: no all-reduce, the measured step.
  const StepPrediction alone = simulate_step(prof, ring(1, 1e6), 4 * kMB);
  EXPECT_DOUBLE_EQ(alone.seconds_per_step, prof.compute());
  EXPECT_DOUBLE_EQ(alone.efficiency, 1);
}

TEST(StepModelTest, CommunicationOnTheComputeCoresStretchesBackward) {
  // 10 MB of gradients, 2 workers: each moves 2 (N-1)/N of a pack's bytes. With an instant link the
  // two full packs (8 MB) are all-reduced inside backward and the last (2 MB) after it: at 10 ns a
  // byte and two workers on the core, backward takes 2 x 1e-8 x 8 MB = 0.16 s longer, and every
  // gradient comes 8% later. The last pack's bytes stretch nothing: backward has ended.
  Network net = ring(2, 1e15);
  net.cpu_seconds_per_byte = 1e-8;
  net.workers_per_core = 2;
  const StepPrediction p = simulate_step(three_gradients(), net, 4 * kMB);
  ASSERT_EQ(p.packs.size(), 3u);
  EXPECT_NEAR(p.packs[0].launch, 0.54, 1e-9);
  EXPECT_NEAR(p.packs[2].launch, 2.16, 1e-9);
  EXPECT_NEAR(p.seconds_per_step, 1 + 2.16 + 0.5 + 0.1, 1e-6);
  // Every byte after backward (one pack of everything, sent when backward ends): no stretch, the
  // step is the measured one plus the all-reduce, 10 MB at 10 MB/s.
  Network slow = ring(2, 10 * kMB);
  slow.cpu_seconds_per_byte = 1e-8;
  const StepPrediction tail = simulate_step(three_gradients(), slow, 1000 * kMB);
  ASSERT_EQ(tail.packs.size(), 1u);
  EXPECT_DOUBLE_EQ(tail.packs[0].launch, 2.0);
  EXPECT_NEAR(tail.seconds_per_step, 1 + 2 + 1 + 0.5 + 0.1, 1e-9);
  // One 10 MB pack launched by a gradient at 0 (1 s on the link): all of it inside a backward of
  // 2 s and more; stretch = 1 + 1e-8 x 10 MB / 2 s = 1.05.
  StepProfile early = three_gradients();
  early.gradients = {{0.0, 10 * kMB}};
  const StepPrediction inside = simulate_step(early, slow, 4 * kMB);
  ASSERT_EQ(inside.packs.size(), 1u);
  EXPECT_NEAR(inside.seconds_per_step, 1 + 2.1 + 0.5 + 0.1, 1e-9);
  EXPECT_DOUBLE_EQ(inside.hidden_share, 1);
  // The same pack launched at 1.5 s straddles backward's end: charged for its share inside. With
  // stretch s, backward ends at 2s and the pack runs from 1.5s for 1 s, (2s - 1.5s) of it inside,
  // so s = 1 + 1e-8 x 10 MB x 0.5s / 2 s = 1 + 0.025 s: s = 40/39. The pack ends at 1.5s + 1.
  early.gradients = {{1.5, 10 * kMB}};
  const StepPrediction straddles = simulate_step(early, slow, 4 * kMB);
  ASSERT_EQ(straddles.packs.size(), 1u);
  const double s = 40.0 / 39;
  EXPECT_NEAR(straddles.packs[0].launch, 1.5 * s, 1e-9);
  EXPECT_NEAR(straddles.seconds_per_step, 1 + 1.5 * s + 1 + 0.5 + 0.1, 1e-9);
  EXPECT_NEAR(straddles.hidden_share, 0.5 * s, 1e-9);
  EXPECT_DOUBLE_EQ(p.compute_seconds, 3.6);  // efficiency stays against the one-worker step
  net.workers = 1;                           // nothing moved
  EXPECT_DOUBLE_EQ(simulate_step(three_gradients(), net, 4 * kMB).seconds_per_step, 3.6);
}

nlohmann::json span(const char* name, double ts, double dur, long pid = 7, long tid = 0) {
  return {{"ph", "X"},  {"name", name}, {"cat", "compute"}, {"ts", ts},
          {"dur", dur}, {"pid", pid},   {"tid", tid}};
}
nlohmann::json ready(long index, long bytes, double ts, long pid = 7) {
  return {{"ph", "X"},
          {"name", "gradient " + std::to_string(index) + ": " + std::to_string(bytes) + " B"},
          {"cat", "gradient"},
          {"ts", ts},
          {"dur", 0},
          {"pid", pid},
          {"tid", 0}};
}

// Three steps of 10 ms each (microseconds): forward 2 ms, backward 5 ms, update 1 ms, 2 ms gap.
nlohmann::json trace(bool gradients = true) {
  nlohmann::json ev = nlohmann::json::array();
  ev.push_back({{"ph", "M"}, {"name", "process_name"}, {"pid", 7}, {"args", {{"name", "w0"}}}});
  for (int k = 0; k < 3; ++k) {
    const double slow = k == 0 ? 3000 : 0;  // the warm-up step is slower
    const double t = 10000.0 * k + (k > 0 ? 3000 : 0);
    ev.push_back(span("forward", t, 2000 + slow));
    ev.push_back(span("backward", t + 2000 + slow, 5000));
    ev.push_back(span("optimizer update", t + 7000 + slow, 1000));
    if (gradients) {
      // Gradient 3 first (the last layer), then 2, then 1; k = 2 is 200 us later for gradient 2.
      ev.push_back(ready(3, 400, t + 2000 + slow + 1000));
      ev.push_back(ready(2, 800, t + 2000 + slow + 2000 + (k == 2 ? 200 : 0)));
      ev.push_back(ready(1, 100, t + 2000 + slow + 5000));
    }
  }
  ev.push_back(span("backward", 0, 99999, /*pid=*/8));  // a later process: ignored
  ev.push_back(ready(9, 1, 5000, /*pid=*/8));
  return {{"traceEvents", ev}};
}

TEST(StepModelTest, ProfileComesFromTheTimelinesSpansAndGradientEvents) {
  const StepProfile p = profile_from_timeline(trace(), /*warmup=*/1);
  EXPECT_EQ(p.steps, 2);
  EXPECT_DOUBLE_EQ(p.forward, 0.002);
  EXPECT_DOUBLE_EQ(p.backward, 0.005);
  EXPECT_DOUBLE_EQ(p.update, 0.001);
  EXPECT_DOUBLE_EQ(p.other, 0.002);   // step 2's update end to step 3's forward (step 3 has none)
  ASSERT_EQ(p.gradients.size(), 3u);  // process 8's gradient 9 is not read
  EXPECT_DOUBLE_EQ(p.gradients[0].at, 0.001);
  EXPECT_DOUBLE_EQ(p.gradients[0].bytes, 400);
  EXPECT_DOUBLE_EQ(p.gradients[1].at, 0.0021);  // median of 2.0 and 2.2 ms
  EXPECT_DOUBLE_EQ(p.gradients[2].bytes, 100);
  EXPECT_DOUBLE_EQ(p.gradient_bytes(), 1300);
  EXPECT_DOUBLE_EQ(p.compute(), 0.010);
  // The warm-up step counts when asked to.
  EXPECT_EQ(profile_from_timeline(trace(), 0).steps, 3);
  // Only the last step left: it has no next forward, so nothing is "other" (this crashed once).
  const StepProfile last = profile_from_timeline(trace(), 2);
  EXPECT_EQ(last.steps, 1);
  EXPECT_DOUBLE_EQ(last.other, 0);
  const StepProfile half = p.scaled(0.5);
  EXPECT_DOUBLE_EQ(half.compute(), 0.005);
  EXPECT_DOUBLE_EQ(half.gradients[1].at, 0.00105);
  EXPECT_DOUBLE_EQ(half.gradient_bytes(), 1300);
}

TEST(StepModelTest, ProfileErrorsSayWhatIsMissing) {
  auto message = [](const nlohmann::json& t, int warmup) -> std::string {
    try {
      profile_from_timeline(t, warmup);
    } catch (const std::runtime_error& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_NE(message(nlohmann::json::object({{"traceEvents", nlohmann::json::array()}}), 0)
                .find("no \"backward\" span"),
            std::string::npos);
  EXPECT_NE(message(trace(/*gradients=*/false), 1).find("no \"gradient I: B B\" events"),
            std::string::npos);
  EXPECT_NE(message(trace(), 5).find("lower --warmup"), std::string::npos);
  EXPECT_NE(message(nlohmann::json(3), 0).find("not a Chrome trace"), std::string::npos);
}

// /proc/stat's per-core lines: the all-CPU line and malformed lines left out, guest time not
// counted twice, cores matched by their number (not their position), the most-stolen of the cores
// asked for reported, and unknown (NaN) rather than 0 where no core can be compared; a kernel
// without a steal column reads as none stolen.
TEST(BenchUtilTest, StealShareIsTheLargestShareOfOneCore) {
  const CpuTicks before = parse_cpu_ticks(
      "cpu  200 0 0 200 0 0 0 20 0 0\n"
      "cpu0 100 0 0 100 0 0 0 10 50 0\n"
      "cpu1 100 0 0 100 0 0 0 10 0 0\n"
      "cpu2\n"
      "cpu3 x 1 2\n"
      "intr 12345\n");
  ASSERT_EQ(before.cores.size(), 2u);
  EXPECT_EQ(before.cores[0].cpu, 0);
  EXPECT_EQ(before.cores[1].cpu, 1);
  EXPECT_EQ(before.cores[0].total, 210u);  // guest's 50 is already in user's 100
  EXPECT_EQ(before.cores[0].steal, 10u);
  // 100 ticks pass on each core: core 0 busy and 8 stolen, core 1 idle and 2 stolen; listed in
  // another order.
  const CpuTicks after = parse_cpu_ticks(
      "cpu  300 0 0 300 0 0 0 30 0 0\n"
      "cpu1 100 0 0 198 0 0 0 12 0 0\n"
      "cpu0 192 0 0 100 0 0 0 18 50 0\n");
  EXPECT_DOUBLE_EQ(steal_share(before, after), 0.08);
  EXPECT_DOUBLE_EQ(steal_share(before, after, {1}), 0.02);  // a run pinned to core 1
  EXPECT_DOUBLE_EQ(steal_share(before, after, {0, 1}), 0.08);
  EXPECT_TRUE(std::isnan(steal_share(before, before)));  // no tick elapsed
  EXPECT_TRUE(std::isnan(steal_share(before, CpuTicks{})));
  EXPECT_TRUE(std::isnan(steal_share(before, after, {5})));  // a core neither snapshot has
  // Core 0 gone offline and core 7 come online: core 1 alone compares.
  const CpuTicks moved = parse_cpu_ticks(
      "cpu1 100 0 0 198 0 0 0 12 0 0\n"
      "cpu7 500 0 0 500 0 0 0 500 0 0\n");
  EXPECT_DOUBLE_EQ(steal_share(before, moved), 0.02);
  const CpuTicks old_kernel = parse_cpu_ticks("cpu0 1 2 3 4 5 6 7\n");
  ASSERT_EQ(old_kernel.cores.size(), 1u);
  EXPECT_EQ(old_kernel.cores[0].total, 28u);
  EXPECT_EQ(old_kernel.cores[0].steal, 0u);
  EXPECT_FALSE(cpu_ticks().cores.empty());  // this machine's own /proc/stat
}

}  // namespace
}  // namespace dtrain::bench
