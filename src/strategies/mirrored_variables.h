// Private to src/strategies: the variables MirroredStrategy and CentralStorageStrategy create.
#pragma once

#include <atomic>
#include <memory>

#include "dtrain/model/variable.h"
#include "dtrain/strategies/strategy.h"

namespace dtrain {

// One copy per replica device (TF's MirroredVariable for ON_WRITE, SyncOnReadVariable for ON_READ).
// With `shared` (host devices, ON_WRITE only), the copies are handles of one block of memory: a
// write lands once (cross-replica: on the block; replica context: from replica 0 between two
// barriers), and update() in replica context hands each replica the block, to write its slice
// during a sharded update (MirroredReplicaContext::in_sharded_update), else runs on replica 0 only.
//
// With a `gatherer` (Sharding::kParameters, trainable float variables), the copies may hold only
// their replica's part (ZeRO-3): the first release() of a copy keeps its part and drops its whole
// value; gather() gives it whole memory again. The tensor handle of each copy stays the same
// throughout (release_memory/adopt_memory), so tapes follow it across gathers. The variable may
// outlive its strategy (a model returned by a function that trained it): it holds the gatherer
// weakly, and the gatherer's destructor makes it whole again from its parts where this process
// holds them all (make_whole_locally); then it is a plain mirrored variable and
// parameter_gatherer() is nullptr. In a job of several workers it keeps its part, and a read says
// the rest went with the strategy.
class MirroredVariable final : public Variable {
 public:
  MirroredVariable(VariableSpec spec, const Strategy* owner, const std::vector<DeviceSpec>& devices,
                   bool shared = false, std::shared_ptr<ParameterGatherer> gatherer = nullptr);
  bool shares_storage() const { return shared_; }
  Tensor read_value() const override;
  void do_assign(const Tensor& v) override { write(v, Kind::kAssign); }
  void do_assign_add(const Tensor& d) override { write(d, Kind::kAdd); }
  void do_assign_sub(const Tensor& d) override { write(d, Kind::kSub); }
  void do_update(const std::function<void(Tensor& value, size_t copy_index)>& fn) override;
  std::vector<Tensor> device_values() const override;
  // The strategy's gatherer while the strategy lives (it owns it), else nullptr.
  std::shared_ptr<ParameterGatherer> parameter_gatherer() const override {
    return gatherer_.lock();
  }
  std::vector<ValuePart> value_parts() const override;

  // For the gatherer (sharded_parameters.cc), on local copy `l`'s replica thread:
  // whether copy l holds only a part (it has been released once); its part; its handle.
  bool holds_part(size_t l) const { return parts_[l].value.defined(); }
  const ValuePart& part(size_t l) const { return parts_[l]; }
  Tensor& copy(size_t l) { return values_[l]; }
  // Keeps part `part` of `parts` of copy l (carved from its whole value the first time) and
  // drops the whole value's memory.
  void release_copy(size_t l, int part, int parts);
  // Every copy whole again and the parts dropped, when this process holds every part (or a copy
  // is still whole); false, changing nothing, when other workers hold some. For the gatherer's
  // destructor: a variable that outlives its strategy then reads, trains and updates as any.
  bool make_whole_locally();
  // Whether a layer has gathered this variable (then the gatherer, not the update's all-gather of
  // parts, keeps its copies whole or partial).
  bool managed() const { return managed_.load(std::memory_order_acquire); }
  void set_managed() { managed_.store(true, std::memory_order_release); }

 private:
  enum class Kind { kAssign, kAdd, kSub };
  void write(const Tensor& v, Kind kind);
  bool on_read() const { return spec_.synchronization == VariableSynchronization::kOnRead; }
  // The replica context of the owning strategy on this thread, or nullptr (cross-replica).
  ReplicaContext* my_replica() const;
  // Global replica ids are worker rank x local replicas + local index; the worker rank may change
  // (an elastic job's new membership), the local index does not.
  size_t local(const ReplicaContext& ctx) const {
    return static_cast<size_t>(ctx.replica_id_in_sync_group()) % values_.size();
  }
  // The whole value from the local parts (cross-replica reads in a one-process job).
  Tensor assemble() const;
  const Strategy* owner_;
  std::vector<Tensor> values_;
  bool shared_ = false;
  std::weak_ptr<ParameterGatherer> gatherer_;  // expired once the strategy is destroyed
  std::vector<ValuePart> parts_;  // per local copy; value undefined while the copy is whole
  std::atomic<bool> managed_{false};
};

// A single copy on the parameter device; replicas read a per-step copy on their own device.
class CentralVariable final : public Variable {
 public:
  CentralVariable(VariableSpec spec, const Strategy* owner, DeviceSpec parameter_device,
                  size_t replicas);
  Tensor read_value() const override;
  void do_assign(const Tensor& v) override { write(v, 0); }
  void do_assign_add(const Tensor& d) override { write(d, 1); }
  void do_assign_sub(const Tensor& d) override { write(d, -1); }
  void do_update(const std::function<void(Tensor& value, size_t copy_index)>& fn) override;
  std::vector<Tensor> device_values() const override { return {storage_}; }

 private:
  void write(const Tensor& v, int sign);
  ReplicaContext* my_replica() const;
  const Strategy* owner_;
  Tensor storage_;
  std::atomic<uint64_t> version_{0};
  struct Cached {
    uint64_t version = ~uint64_t{0};
    Tensor copy;
  };
  mutable std::vector<Cached> cache_;  // per replica; written only by that replica's thread
};

}  // namespace dtrain
