// Private to src/train: how a model's outputs are scored (Keras' compile()): a loss per output with
// its weight, and metrics per output, over batches whose first num_inputs() components are the
// model's inputs and the next num_outputs() its labels. Tally holds one pass's sums.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/nn/metrics.h"
#include "dtrain/nn/model.h"
#include "dtrain/train/fit.h"

namespace dtrain::detail {

// The loss sum and the metrics of one pass, updated concurrently by replicas.
struct Tally {
  struct Entry {
    size_t output;  // which model output the metric reads
    std::string name;
    std::unique_ptr<Metric> metric;
  };
  Mean loss{"loss"};
  std::vector<Entry> metrics;

  void reset();
  std::map<std::string, std::vector<double>> states() const;
  void set_states(const std::map<std::string, std::vector<double>>& s);
  // Flattened metric states (loss excluded), for one all-reduce.
  std::vector<double> flat_metric_states() const;
  // Results of the metrics from flattened (summed) states starting at `at`.
  void put_results(const std::vector<double>& flat, size_t at, const std::string& prefix,
                   std::map<std::string, double>* values) const;
  // This process's results so far, by name.
  void put_local_results(std::map<std::string, double>* values) const;
};

class Heads {
 public:
  // Throws InvalidArgument when `losses` or `loss_weights` are given with another length than the
  // model's outputs, or `loss` and `losses` are both set.
  // Throws InvalidArgument also for an output_metrics key that names no output.
  Heads(const Model& model, const FitOptions& options);
  int num_inputs() const { return inputs_; }
  int num_outputs() const { return static_cast<int>(losses_.size()); }
  // The model's inputs of a replica's batch; throws InvalidArgument naming what the dataset lacks.
  std::vector<Tensor> inputs(const std::vector<Tensor>& batch) const;
  const Tensor& labels(const std::vector<Tensor>& batch, size_t output) const {
    return batch[static_cast<size_t>(inputs_) + output];
  }
  // Runs the model on the batch's inputs; throws InvalidArgument when it returns another number of
  // outputs than it declares.
  std::vector<Tensor> forward(Model& model, const std::vector<Tensor>& batch, bool training) const;
  // sum_i weight_i * compute_average_loss(loss_i(output_i, labels_i), global_rows).
  Tensor average_loss(const std::vector<Tensor>& outs, const std::vector<Tensor>& batch,
                      int64_t global_rows) const;
  // sum_i weight_i * sum over rows of loss_i (for evaluation: divided by the rows later).
  double loss_sum(const std::vector<Tensor>& outs, const std::vector<Tensor>& batch) const;
  void update_metrics(Tally& tally, const std::vector<Tensor>& outs,
                      const std::vector<Tensor>& batch) const;
  std::unique_ptr<Tally> make_tally() const;

 private:
  int inputs_;
  std::vector<LossFn> losses_;
  std::vector<float> weights_;
  struct MetricSpec {
    size_t output;
    std::string name;    // as make_metric knows it
    std::string logged;  // as the logs show it
  };
  std::vector<MetricSpec> metric_specs_;
};

}  // namespace dtrain::detail
