// Streaming metrics (Keras style). A metric keeps sums (its state: e.g. correct and total for
// accuracy); result() divides them. Sums make aggregation exact: adding the states of every
// replica and every worker and then dividing gives the metric over all examples, never a mean of
// per-replica means (fit() and evaluate() do that with one all-reduce of the states).
//
// Thread-safety: update_state() may be called concurrently by replicas; every method locks.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "dtrain/core/export.h"
#include "dtrain/core/tensor.h"

namespace dtrain {

class DTRAIN_API Metric {
 public:
  Metric(std::string name, size_t state_size);
  virtual ~Metric() = default;
  const std::string& name() const { return name_; }
  // Adds one batch: predictions [N, ...] (logits for the classification metrics) and labels.
  // Throws InvalidArgument naming the metric and both shapes when they do not fit.
  virtual void update_state(const Tensor& predictions, const Tensor& labels) = 0;
  double result() const { return result_of(state()); }
  // The sums; the metric over several states is result_of(element-wise sum of the states).
  std::vector<double> state() const;
  void set_state(std::vector<double> state);
  virtual double result_of(const std::vector<double>& state) const;  // default: state[0] / state[1]
  void reset_state();

 protected:
  void add(const std::vector<double>& delta);

 private:
  std::string name_;
  mutable std::mutex mu_;
  std::vector<double> state_;
};

// Fraction of rows whose argmax(logits [N, C]) equals the int32 label [N] (or [N, 1]).
class DTRAIN_API SparseCategoricalAccuracy : public Metric {
 public:
  explicit SparseCategoricalAccuracy(std::string name = "sparse_categorical_accuracy");
  void update_state(const Tensor& logits, const Tensor& labels) override;
  void update(const Tensor& logits, const Tensor& labels) { update_state(logits, labels); }
  int64_t count() const { return static_cast<int64_t>(state()[1]); }
  void reset() { reset_state(); }
};

// Fraction of rows whose label is among the k largest logits (ties count for the label).
class DTRAIN_API SparseTopKCategoricalAccuracy : public Metric {
 public:
  explicit SparseTopKCategoricalAccuracy(int k = 5,
                                         std::string name = "sparse_top_k_categorical_accuracy");
  void update_state(const Tensor& logits, const Tensor& labels) override;

 private:
  int k_;
};

// Fraction of elements where round-free equality predictions == labels holds (keras Accuracy);
// labels of any numeric dtype, same number of elements.
class DTRAIN_API Accuracy : public Metric {
 public:
  explicit Accuracy(std::string name = "accuracy");
  void update_state(const Tensor& predictions, const Tensor& labels) override;
};

// Mean over all elements of (predictions - labels)^2, or |predictions - labels| (absolute).
class DTRAIN_API MeanSquaredError : public Metric {
 public:
  explicit MeanSquaredError(std::string name = "mean_squared_error");
  void update_state(const Tensor& predictions, const Tensor& labels) override;
};
class DTRAIN_API MeanAbsoluteError : public Metric {
 public:
  explicit MeanAbsoluteError(std::string name = "mean_absolute_error");
  void update_state(const Tensor& predictions, const Tensor& labels) override;
};

// Weighted mean of values (keras Mean): update(value, weight), or update_state(values, ignored)
// for the mean of a tensor's elements.
class DTRAIN_API Mean : public Metric {
 public:
  explicit Mean(std::string name = "mean");
  void update(double value, double weight = 1.0);
  void update_state(const Tensor& values, const Tensor& ignored) override;
  void reset() { reset_state(); }
};

// A metric by the name Keras' compile(metrics=[...]) takes: "accuracy" (sparse categorical
// accuracy for integer labels, reported as "accuracy"), "sparse_categorical_accuracy",
// "top_k" / "sparse_top_k_categorical_accuracy" (k = 5; "top_3" for k = 3), "mse" /
// "mean_squared_error", "mae" / "mean_absolute_error". Throws InvalidArgument listing the names.
DTRAIN_API std::unique_ptr<Metric> make_metric(const std::string& name);

}  // namespace dtrain
