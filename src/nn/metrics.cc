#include "dtrain/nn/metrics.h"

#include <algorithm>
#include <cmath>

#include "dtrain/core/error.h"
#include "dtrain/model/ops.h"

namespace dtrain {

namespace {

// Any numeric tensor's elements as doubles, on the host.
std::vector<double> host_values(const Tensor& t) {
  const Tensor h = t.to(DeviceSpec::cpu());
  std::vector<double> out;
  switch (h.dtype()) {
    case DType::kInt32:
      for (int32_t v : h.to_vector<int32_t>()) out.push_back(v);
      return out;
    case DType::kInt64:
      for (int64_t v : h.to_vector<int64_t>()) out.push_back(static_cast<double>(v));
      return out;
    case DType::kFloat32:
      for (float v : h.to_vector<float>()) out.push_back(v);
      return out;
    case DType::kFloat64:
      return h.to_vector<double>();
    default:
      for (float v : ops::cast(h, DType::kFloat32).to_vector<float>()) out.push_back(v);
      return out;
  }
}

InvalidArgument shape_error(const std::string& metric, const char* want, const Tensor& p,
                            const Tensor& y) {
  return InvalidArgument(metric + " expects " + want + ", got predictions " +
                         p.shape().to_string() + " and labels " + y.shape().to_string());
}

// Checks logits [N, C] and labels [N] or [N, 1] with class ids in [0, C).
void check_sparse(const std::string& metric, const Tensor& logits, const Tensor& labels) {
  const bool labels_ok = labels.rank() == 1 || (labels.rank() == 2 && labels.shape()[1] == 1);
  if (logits.rank() != 2 || !labels_ok || logits.shape()[0] != labels.shape()[0])
    throw shape_error(metric, "logits [N, C] and integer labels [N]", logits, labels);
  if (labels.dtype() != DType::kInt32 && labels.dtype() != DType::kInt64)
    throw InvalidArgument(metric + " expects integer class labels, got " +
                          dtype_name(labels.dtype()) +
                          " labels (a regression target? use metrics such as mse or mae)");
}

}  // namespace

Metric::Metric(std::string name, size_t n) : name_(std::move(name)), state_(n, 0.0) {}

std::vector<double> Metric::state() const {
  std::lock_guard<std::mutex> lock(mu_);
  return state_;
}

void Metric::set_state(std::vector<double> s) {
  std::lock_guard<std::mutex> lock(mu_);
  if (s.size() != state_.size())
    throw InvalidArgument("metric '" + name_ + "' has " + std::to_string(state_.size()) +
                          " state values, got " + std::to_string(s.size()));
  state_ = std::move(s);
}

double Metric::result_of(const std::vector<double>& s) const {
  return s.at(1) > 0 ? s[0] / s[1] : 0.0;
}

void Metric::reset_state() {
  std::lock_guard<std::mutex> lock(mu_);
  std::fill(state_.begin(), state_.end(), 0.0);
}

void Metric::add(const std::vector<double>& d) {
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t i = 0; i < state_.size(); ++i) state_[i] += d[i];
}

SparseCategoricalAccuracy::SparseCategoricalAccuracy(std::string name)
    : Metric(std::move(name), 2) {}

void SparseCategoricalAccuracy::update_state(const Tensor& logits, const Tensor& labels) {
  check_sparse(name(), logits, labels);
  const int64_t n = logits.shape()[0], c = logits.shape()[1];
  const std::vector<double> l = host_values(logits), y = host_values(labels);
  double correct = 0;
  for (int64_t i = 0; i < n; ++i) {
    int64_t best = 0;
    for (int64_t j = 1; j < c; ++j)
      if (l[static_cast<size_t>(i * c + j)] > l[static_cast<size_t>(i * c + best)]) best = j;
    correct += static_cast<double>(best) == y[static_cast<size_t>(i)];
  }
  add({correct, static_cast<double>(n)});
}

SparseTopKCategoricalAccuracy::SparseTopKCategoricalAccuracy(int k, std::string name)
    : Metric(std::move(name), 2), k_(k) {
  if (k < 1) throw InvalidArgument("top-k accuracy needs k >= 1, got " + std::to_string(k));
}

void SparseTopKCategoricalAccuracy::update_state(const Tensor& logits, const Tensor& labels) {
  check_sparse(name(), logits, labels);
  const int64_t n = logits.shape()[0], c = logits.shape()[1];
  const std::vector<double> l = host_values(logits), y = host_values(labels);
  double correct = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t label = static_cast<int64_t>(y[static_cast<size_t>(i)]);
    if (label < 0 || label >= c) continue;
    const double target = l[static_cast<size_t>(i * c + label)];
    int64_t above = 0;  // classes strictly better than the label's
    for (int64_t j = 0; j < c; ++j) above += l[static_cast<size_t>(i * c + j)] > target;
    correct += above < k_;
  }
  add({correct, static_cast<double>(n)});
}

Accuracy::Accuracy(std::string name) : Metric(std::move(name), 2) {}

void Accuracy::update_state(const Tensor& p, const Tensor& y) {
  if (p.numel() != y.numel()) throw shape_error(name(), "as many predictions as labels", p, y);
  const std::vector<double> a = host_values(p), b = host_values(y);
  double equal = 0;
  for (size_t i = 0; i < a.size(); ++i) equal += a[i] == b[i];
  add({equal, static_cast<double>(a.size())});
}

namespace {
template <typename F>
std::vector<double> elementwise_sum(const std::string& metric, const Tensor& p, const Tensor& y,
                                    F f) {
  if (p.numel() != y.numel() || p.shape()[0] != y.shape()[0])
    throw shape_error(metric, "predictions and labels of the same size, e.g. [N, 1] and [N, 1]", p,
                      y);
  const std::vector<double> a = host_values(p), b = host_values(y);
  double sum = 0;
  for (size_t i = 0; i < a.size(); ++i) sum += f(a[i] - b[i]);
  return {sum, static_cast<double>(a.size())};
}
}  // namespace

MeanSquaredError::MeanSquaredError(std::string name) : Metric(std::move(name), 2) {}
void MeanSquaredError::update_state(const Tensor& p, const Tensor& y) {
  add(elementwise_sum(name(), p, y, [](double d) { return d * d; }));
}

MeanAbsoluteError::MeanAbsoluteError(std::string name) : Metric(std::move(name), 2) {}
void MeanAbsoluteError::update_state(const Tensor& p, const Tensor& y) {
  add(elementwise_sum(name(), p, y, [](double d) { return std::fabs(d); }));
}

Mean::Mean(std::string name) : Metric(std::move(name), 2) {}
void Mean::update(double value, double weight) { add({value * weight, weight}); }
void Mean::update_state(const Tensor& values, const Tensor&) {
  double sum = 0;
  const std::vector<double> v = host_values(values);
  for (double x : v) sum += x;
  add({sum, static_cast<double>(v.size())});
}

std::unique_ptr<Metric> make_metric(const std::string& name) {
  if (name == "accuracy" || name == "acc")
    return std::make_unique<SparseCategoricalAccuracy>("accuracy");
  if (name == "sparse_categorical_accuracy") return std::make_unique<SparseCategoricalAccuracy>();
  if (name == "top_k" || name == "sparse_top_k_categorical_accuracy")
    return std::make_unique<SparseTopKCategoricalAccuracy>(5, name);
  if (name.rfind("top_", 0) == 0 && name.size() > 4 && name.size() < 12 &&
      name.find_first_not_of("0123456789", 4) == std::string::npos)
    return std::make_unique<SparseTopKCategoricalAccuracy>(std::stoi(name.substr(4)), name);
  if (name == "mse" || name == "mean_squared_error")
    return std::make_unique<MeanSquaredError>(name);
  if (name == "mae" || name == "mean_absolute_error")
    return std::make_unique<MeanAbsoluteError>(name);
  throw InvalidArgument("unknown metric '" + name +
                        "' (accuracy, sparse_categorical_accuracy, top_k, top_<k>, mse, mae)");
}

}  // namespace dtrain
