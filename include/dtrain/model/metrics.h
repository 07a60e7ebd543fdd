// Streaming metrics (Keras style). update() may be called concurrently by replicas; result()
// combines everything seen since reset().
#pragma once

#include "dtrain/core/export.h"

#include <cstdint>
#include <mutex>

#include "dtrain/core/tensor.h"

namespace dtrain {

// Fraction of rows whose argmax(logits) equals the int32 label.
class DTRAIN_API SparseCategoricalAccuracy {
 public:
  void update(const Tensor& logits, const Tensor& labels);
  double result() const;
  int64_t count() const;
  void reset();

 private:
  mutable std::mutex mu_;
  int64_t correct_ = 0, total_ = 0;
};

// Weighted mean of scalar values (e.g. the loss per step).
class DTRAIN_API Mean {
 public:
  void update(double value, double weight = 1.0);
  double result() const;
  void reset();

 private:
  mutable std::mutex mu_;
  double sum_ = 0, weight_ = 0;
};

}  // namespace dtrain
