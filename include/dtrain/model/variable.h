// Variables: named, mutable tensors that survive across steps (weights, optimizer slots,
// batch-norm statistics). Layers never construct one directly: they call create_variable(spec),
// which asks the innermost VariableCreator on this thread's creator stack to make it (TF's
// variable_creator_scope). strategy.scope() pushes its strategy there, so the same layer code
// yields a plain variable under OneDevice, a mirrored one under Mirrored and a PS handle under
// ParameterServer, while this file knows nothing of strategies. With no creator on the stack, a
// plain variable on CPU:0 is made (what TF's default strategy does).
//
// Thread-safety: value() may be called from any replica thread; each replica reads its own copy.
// Writes from several replicas follow the variable's synchronization/aggregation (TF semantics).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/core/export.h"
#include "dtrain/core/tensor.h"

namespace dtrain {

// TF's tf.VariableSynchronization.
enum class VariableSynchronization { kAuto, kOnWrite, kOnRead, kNone };
// TF's tf.VariableAggregation: how writes from several replicas combine.
enum class VariableAggregation { kNone, kSum, kMean, kOnlyFirstReplica };

class Variable;

// Parameters sharded across replicas (ZeRO-3, FSDP's FULL_SHARD): a variable whose replicas keep
// only their part of its value between uses. A layer marked with Layer::set_shard_parameters
// gathers its variables for its call and releases them after; the strategy that made them
// implements this. Calls outside the owning strategy's replica context do nothing on variables
// that are still whole.
class DTRAIN_API ParameterGatherer {
 public:
  virtual ~ParameterGatherer() = default;
  // Makes the whole values of `vars` readable on the calling replica: one collective for all of
  // them (or the prefetch started for them earlier), then starts the gather of the group of
  // variables that followed this one the last time (FSDP's forward and backward prefetch).
  virtual void gather(const std::vector<std::shared_ptr<Variable>>& vars) = 0;
  // Drops the calling replica's whole values of `vars`, keeping its part. Tensors handed out
  // while they were gathered stay valid (they hold the memory until they are dropped).
  virtual void release(const std::vector<std::shared_ptr<Variable>>& vars) = 0;
};

// One replica's part of a parameter-sharded variable: flat elements [first, first + numel) of
// the value, part `part` of `parts` (Strategy::update_partition's partition).
struct DTRAIN_API ValuePart {
  int part = 0;
  int parts = 1;
  int64_t first = 0;
  Tensor value;  // flat
};

// Produces the initial value on `device`. Initializers in model/initializers.h are seeded.
using Initializer = std::function<Tensor(const Shape& shape, DType dtype, DeviceSpec device)>;

struct DTRAIN_API VariableSpec {
  std::string name;
  Shape shape;
  DType dtype = DType::kFloat32;
  Initializer initializer;  // required
  bool trainable = true;
  VariableSynchronization synchronization = VariableSynchronization::kAuto;
  VariableAggregation aggregation = VariableAggregation::kNone;
};

class DTRAIN_API Variable {
 public:
  explicit Variable(VariableSpec spec) : spec_(std::move(spec)) {}
  virtual ~Variable() = default;
  Variable(const Variable&) = delete;
  Variable& operator=(const Variable&) = delete;

  const std::string& name() const { return spec_.name; }
  const Shape& shape() const { return spec_.shape; }
  DType dtype() const { return spec_.dtype; }
  bool trainable() const { return spec_.trainable; }
  const VariableSpec& spec() const { return spec_; }

  // The value the calling replica reads (its own device's copy), or the primary copy in
  // cross-replica context. The handle aliases the variable's memory: in-place kernels update it.
  // Throws FailedPrecondition inside the run() of a strategy other than the one that made the
  // variable (or inside any strategy's run() for a variable made outside every scope).
  Tensor value() const {
    check_strategy("read");
    return read_value();
  }
  // Writes, with the variable's aggregation applied across replicas when called in replica
  // context. Throw InvalidArgument on a shape/dtype mismatch.
  // Throw FailedPrecondition as value() does.
  void assign(const Tensor& v) {
    check_strategy("assigned");
    do_assign(v);
  }
  void assign_add(const Tensor& delta) {
    check_strategy("assigned");
    do_assign_add(delta);
  }
  void assign_sub(const Tensor& delta) {
    check_strategy("assigned");
    do_assign_sub(delta);
  }
  // Runs fn(copy, copy_index) on each copy this call owns: in replica context the replica's own
  // copy (mirrored) or the single central copy from replica 0 only (central storage); in
  // cross-replica context every copy. copy_index indexes device_values() and lines up across the
  // variables of one strategy, so an optimizer pairs a variable's copy with its slots' copies.
  // Optimizers call it with a gradient that is identical on every replica, so copies stay equal.
  // Throws FailedPrecondition as value() does.
  void update(const std::function<void(Tensor& value, size_t copy_index)>& fn) {
    check_strategy("updated");
    do_update(fn);
  }
  // Every device copy (one for a plain variable). Throws FailedPrecondition for a variable whose
  // copies hold only their parts (value_parts()).
  virtual std::vector<Tensor> device_values() const { return {value()}; }

  // ZeRO-3: the strategy's gatherer when this variable may be kept sharded; nullptr otherwise, and
  // once that strategy is destroyed (its variables are whole again then, where one process holds
  // every part). Shared: a caller keeps it alive for the call it serves, and holds it weakly
  // anywhere it may outlive the strategy (a tape's backward pass).
  virtual std::shared_ptr<ParameterGatherer> parameter_gatherer() const { return nullptr; }
  // This process's parts of the value, one per local replica, when its replicas hold only their
  // parts (after the first release()); empty while the variable is whole. update() in replica
  // context then hands each replica its part (flat) instead of the whole value.
  virtual std::vector<ValuePart> value_parts() const { return {}; }

  // Variables that live in another process (ParameterServer) are updated where they live, as TF
  // colocates an optimizer's update with its variable: the optimizer hands over its config()
  // and the gradient instead of updating a local copy, and keeps no local slots for them.
  virtual bool updates_remotely() const { return false; }
  // Throws Internal unless updates_remotely().
  virtual void apply_remote_update(const std::string& optimizer_config, const Tensor& grad);

  // The creator (a strategy) that made the variable: its name (for messages) and its
  // VariableCreator::instance_id() (0: made directly, not through create_variable; never checked).
  // Set once by create_variable().
  const std::string& strategy_name() const { return strategy_name_; }
  uint64_t strategy_id() const { return strategy_id_; }
  void set_strategy(uint64_t id, std::string name) {
    strategy_id_ = id;
    strategy_name_ = std::move(name);
  }

 protected:
  virtual Tensor read_value() const = 0;
  virtual void do_assign(const Tensor& v) = 0;
  virtual void do_assign_add(const Tensor& delta) = 0;
  virtual void do_assign_sub(const Tensor& delta) = 0;
  virtual void do_update(const std::function<void(Tensor& value, size_t copy_index)>& fn) {
    Tensor v = read_value();
    fn(v, 0);
  }
  // Inside some strategy's run(), throws FailedPrecondition unless it is this variable's strategy.
  void check_strategy(const char* use) const;

  VariableSpec spec_;

 private:
  uint64_t strategy_id_ = 0;
  std::string strategy_name_ = "the default strategy (made outside every strategy.scope())";
};

// A variable with exactly one copy on one device.
class DTRAIN_API PlainVariable : public Variable {
 public:
  PlainVariable(VariableSpec spec, DeviceSpec device);

 protected:
  Tensor read_value() const override { return value_; }
  void do_assign(const Tensor& v) override;
  void do_assign_add(const Tensor& delta) override;
  void do_assign_sub(const Tensor& delta) override;

 private:
  Tensor value_;
};

// What makes variables: a strategy (strategies/strategy.h) or a user's own creator.
//
// Thread-safety: make_variable() is called on the thread whose stack holds the creator.
class DTRAIN_API VariableCreator {
 public:
  VariableCreator();
  virtual ~VariableCreator() = default;
  // The creator's name in messages ("MirroredStrategy").
  virtual std::string name() const = 0;
  // A number unique to this creator object in this process (never reused, never 0); variables
  // record it so that a variable is refused inside another creator's replica code.
  uint64_t instance_id() const { return id_; }
  // Makes the variable (the spec is already checked). Throws what the creator's placement throws.
  virtual std::shared_ptr<Variable> make_variable(const VariableSpec& spec) = 0;

 private:
  uint64_t id_;
};

// While alive, `creator` is the innermost creator on the calling thread (TF's
// variable_creator_scope). Scopes nest; each ends where it began, also when an inner one leaked.
class DTRAIN_API VariableCreatorScope {
 public:
  explicit VariableCreatorScope(VariableCreator* creator);
  ~VariableCreatorScope();
  VariableCreatorScope(VariableCreatorScope&& o) noexcept : depth_(o.depth_) { o.depth_ = -1; }
  VariableCreatorScope(const VariableCreatorScope&) = delete;
  VariableCreatorScope& operator=(const VariableCreatorScope&) = delete;
  VariableCreatorScope& operator=(VariableCreatorScope&&) = delete;

 private:
  int64_t depth_;  // stack size before the push; -1 when moved from
};

// The innermost creator on this thread's stack, or nullptr.
DTRAIN_API VariableCreator* current_variable_creator();

// Asks the innermost creator on this thread (or, with none, makes a plain variable on CPU:0) to
// create a variable, and records the creator in it.
// Throws InvalidArgument if spec.initializer is empty or the shape has a negative dimension.
DTRAIN_API std::shared_ptr<Variable> create_variable(const VariableSpec& spec);

namespace detail {
// The creator whose replica function the calling thread runs (set by a strategy's run() on each
// replica thread; nullptr outside every run()). Variables refuse to be used inside the replica
// code of a creator that is not theirs. Returns the previous one.
DTRAIN_API const VariableCreator* set_running_creator(const VariableCreator* creator);
DTRAIN_API const VariableCreator* running_creator();
}  // namespace detail

}  // namespace dtrain
