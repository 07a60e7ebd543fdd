#include "dtrain/model/metrics.h"

#include <vector>

namespace dtrain {

void SparseCategoricalAccuracy::update(const Tensor& logits, const Tensor& labels) {
  if (logits.rank() != 2 || labels.rank() != 1 || logits.shape()[0] != labels.shape()[0])
    throw InvalidArgument("accuracy expects logits [N, C] and labels [N], got " +
                          logits.shape().to_string() + " and " + labels.shape().to_string());
  const int64_t n = logits.shape()[0], c = logits.shape()[1];
  const std::vector<float> l = logits.to_vector<float>();
  const std::vector<int32_t> y = labels.to_vector<int32_t>();
  int64_t correct = 0;
  for (int64_t i = 0; i < n; ++i) {
    int64_t best = 0;
    for (int64_t j = 1; j < c; ++j)
      if (l[static_cast<size_t>(i * c + j)] > l[static_cast<size_t>(i * c + best)]) best = j;
    correct += best == y[static_cast<size_t>(i)];
  }
  std::lock_guard<std::mutex> lock(mu_);
  correct_ += correct;
  total_ += n;
}

double SparseCategoricalAccuracy::result() const {
  std::lock_guard<std::mutex> lock(mu_);
  return total_ ? static_cast<double>(correct_) / static_cast<double>(total_) : 0.0;
}

int64_t SparseCategoricalAccuracy::count() const {
  std::lock_guard<std::mutex> lock(mu_);
  return total_;
}

void SparseCategoricalAccuracy::reset() {
  std::lock_guard<std::mutex> lock(mu_);
  correct_ = total_ = 0;
}

void Mean::update(double value, double weight) {
  std::lock_guard<std::mutex> lock(mu_);
  sum_ += value * weight;
  weight_ += weight;
}

double Mean::result() const {
  std::lock_guard<std::mutex> lock(mu_);
  return weight_ > 0 ? sum_ / weight_ : 0.0;
}

void Mean::reset() {
  std::lock_guard<std::mutex> lock(mu_);
  sum_ = weight_ = 0;
}

}  // namespace dtrain
