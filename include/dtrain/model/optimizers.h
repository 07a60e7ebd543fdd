// Optimizers (Keras semantics). apply_gradients() called inside a replica all-reduces (SUM) the
// gradients through the replica context first, so losses must be scaled by the global batch
// (losses.h: compute_average_loss), exactly as in TF. The optimizer never asks which strategy runs
// it. Slot variables are made with create_variable(), so they live where their variable lives.
//
// Thread-safety: apply_gradients may be called concurrently by the replicas of one strategy.
#pragma once

#include "dtrain/core/export.h"

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "dtrain/model/variable.h"

namespace dtrain {

class DTRAIN_API Optimizer {
 public:
  explicit Optimizer(float learning_rate);
  virtual ~Optimizer() = default;

  // grads[i] belongs to vars[i]; undefined gradients are skipped (as TF skips None).
  // Throws InvalidArgument when the lists differ in length or a shape differs.
  void apply_gradients(const std::vector<Tensor>& grads,
                       const std::vector<std::shared_ptr<Variable>>& vars);
  // Creates slot variables up front (call inside strategy.scope(); apply_gradients does it lazily).
  void build(const std::vector<std::shared_ptr<Variable>>& vars);
  // Number of apply_gradients calls so far (replica 0's count).
  int64_t iterations() const;
  float learning_rate() const { return lr_; }
  void set_learning_rate(float lr) { lr_ = lr; }
  // All slot variables, for checkpoints.
  std::vector<std::shared_ptr<Variable>> slot_variables() const;

  // The optimizer and its hyper-parameters as one line ("adam 0.001 0.9 0.999 1e-07"), which
  // from_config() turns back into an equal optimizer: how a parameter server learns the job's
  // optimizer. Throws InvalidArgument naming the problem for a malformed line.
  virtual std::string config() const = 0;
  static std::unique_ptr<Optimizer> from_config(const std::string& config);
  int slots_per_variable() const { return num_slots(); }
  // One update of `value` in place, with `slots` (slots_per_variable() tensors shaped like value,
  // zero-initialised before the first step) and the 1-based step count of this variable.
  void apply_dense(Tensor& value, const Tensor& grad, std::vector<Tensor>& slots, int64_t step) {
    update(value, grad, slots, step);
  }

 protected:
  // Number of slots per variable and how to create them.
  virtual int num_slots() const = 0;
  // Applies one update to `value` (this replica's copy) given slots (this replica's copies).
  virtual void update(Tensor& value, const Tensor& grad, std::vector<Tensor>& slots, int64_t step) = 0;
  float lr_;

 private:
  std::vector<std::shared_ptr<Variable>>& slots_for(const Variable* v);
  mutable std::mutex mu_;
  std::map<const Variable*, std::vector<std::shared_ptr<Variable>>> slots_;
  std::map<int, int64_t> steps_;  // per replica id
};

class DTRAIN_API SGD : public Optimizer {
 public:
  explicit SGD(float learning_rate = 0.01f, float momentum = 0.f, bool nesterov = false);
  std::string config() const override;

 protected:
  int num_slots() const override { return momentum_ > 0.f ? 1 : 0; }
  void update(Tensor& value, const Tensor& grad, std::vector<Tensor>& slots, int64_t step) override;

 private:
  float momentum_;
  bool nesterov_;
};

class DTRAIN_API Adam : public Optimizer {
 public:
  explicit Adam(float learning_rate = 1e-3f, float beta1 = 0.9f, float beta2 = 0.999f,
                float epsilon = 1e-7f);
  std::string config() const override;

 protected:
  int num_slots() const override { return 2; }
  void update(Tensor& value, const Tensor& grad, std::vector<Tensor>& slots, int64_t step) override;

 private:
  float beta1_, beta2_, epsilon_;
};

}  // namespace dtrain
