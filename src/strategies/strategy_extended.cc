#include "dtrain/strategies/strategy_extended.h"

#include <algorithm>

#include "dtrain/core/error.h"
#include "dtrain/core/logging.h"

namespace dtrain {

StrategyExtended::StrategyExtended() : policy_(std::make_shared<TrainingPolicy>()) {}

StrategyExtended::StrategyExtended(std::optional<ClusterResolution> cluster,
                                   std::shared_ptr<CrossWorkerOps> cross_worker,
                                   std::shared_ptr<TrainingPolicy> policy)
    : cluster_(std::move(cluster)),
      cross_worker_(std::move(cross_worker)),
      policy_(policy ? std::move(policy) : std::make_shared<TrainingPolicy>()) {}

bool StrategyExtended::is_chief() const { return !cluster_ || cluster_->is_chief(); }

int StrategyExtended::num_workers() const { return cluster_ ? cluster_->num_workers() : 1; }

int StrategyExtended::worker_rank() const {
  return cluster_ ? std::max(cluster_->worker_rank(), 0) : 0;
}

std::vector<double> StrategyExtended::sum_across_workers(std::vector<double> values) {
  if (!cross_worker_ || cross_worker_->num_workers() == 1 || values.empty()) return values;
  Tensor t = Tensor::from_vector<double>(values, Shape{static_cast<int64_t>(values.size())});
  cross_worker_->all_reduce_sum(t);
  return t.to_vector<double>();
}

Tensor StrategyExtended::gather_across_workers(const Tensor& host) {
  if (!cross_worker_ || cross_worker_->num_workers() == 1) return host;
  return cross_worker_->all_gather(host);
}

void StrategyExtended::reduce_across_workers(std::vector<Tensor>& sums,
                                             std::vector<int64_t>& counts) {
  if (!cross_worker_ || cross_worker_->num_workers() == 1) return;
  for (Tensor& s : sums) {
    Tensor h = s.to(DeviceSpec::cpu()).clone();
    cross_worker_->all_reduce_sum(h);
    s = h.to(s.device());
  }
  std::vector<double> c(counts.begin(), counts.end());
  c = sum_across_workers(c);
  for (size_t i = 0; i < counts.size(); ++i) counts[i] = static_cast<int64_t>(c[i]);
}

bool StrategyExtended::agree_on_next(bool have_batch) {
  // DATA: every worker reads the same batches, so they run out together.
  if (!cross_worker_ || cross_worker_->num_workers() == 1 || auto_shard_ != AutoShardPolicy::kOff)
    return have_batch;
  const double ready = sum_across_workers({have_batch ? 1.0 : 0.0})[0];
  if (have_batch && ready < num_workers()) {
    DTRAIN_LOG(INFO) << "another worker ran out of data: all workers stop together";
  }
  return ready == num_workers();
}

void StrategyExtended::set_auto_shard_policy(AutoShardPolicy policy) {
  if (policy == AutoShardPolicy::kFile)
    throw InvalidArgument(
        "AutoShardPolicy::kFile shards by input files, and dtrain datasets are in memory; use "
        "kData or kOff");
  auto_shard_ = policy == AutoShardPolicy::kAuto ? AutoShardPolicy::kData : policy;
}

}  // namespace dtrain
