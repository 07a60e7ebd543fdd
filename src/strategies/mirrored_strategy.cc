#include "dtrain/strategies/mirrored_strategy.h"

#include <exception>

#include "dtrain/collectives/inproc.h"
#include "dtrain/core/logging.h"
#include "dtrain/data/dataset.h"
#include "dtrain/devices/device.h"
#include "strategies/mirrored_impl.h"
#include "strategies/mirrored_variables.h"
#include "strategies/replica_scope.h"

namespace dtrain {

const char* cross_device_ops_name(CrossDeviceOps ops) {
  switch (ops) {
    case CrossDeviceOps::kAuto: return "auto";
    case CrossDeviceOps::kInproc: return "inproc";
    case CrossDeviceOps::kNccl: return "nccl";
    case CrossDeviceOps::kReduceToOneDevice: return "reduce_to_one_device";
  }
  return "?";
}

int64_t InputContext::get_per_replica_batch_size(int64_t global_batch_size) const {
  if (global_batch_size % num_replicas_in_sync != 0)
    throw InvalidArgument("global batch size " + std::to_string(global_batch_size) +
                          " is not divisible by the " + std::to_string(num_replicas_in_sync) + " replicas");
  return global_batch_size / num_replicas_in_sync;
}

void MirroredStrategy::Impl::make_group() {
  CollectiveOptions co;
  co.timeout = options.timeout;
  comms = make_cross_device_group(devices, options.cross_device_ops, co, &chosen);
  if (on_group_made) on_group_made();
}

MirroredStrategy::MirroredStrategy(MirroredOptions options) : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.options = options;
  m.devices = options.devices;
  if (m.devices.empty()) {
    m.devices = list_devices(DeviceType::kCUDA);
    if (m.devices.empty()) m.devices = {DeviceSpec::cpu(0)};
  }
  for (size_t i = 0; i < m.devices.size(); ++i) {
    get_device(m.devices[i]);  // fails now, listing what exists
    for (size_t j = 0; j < i; ++j)
      if (m.devices[i] == m.devices[j])
        throw InvalidArgument("MirroredStrategy: device " + m.devices[i].to_string() +
                              " is listed twice; each replica needs its own device (use --devices=cpu:N)");
  }
  if (options.bytes_per_pack == 0) m.options.bytes_per_pack = ~size_t{0};  // 0 = one pack
  m.make_group();
  m.exchange.resize(m.devices.size());
  for (size_t r = 0; r < m.devices.size(); ++r) {
    m.comm_threads.push_back(std::make_unique<WorkerThread>(nullptr));
    m.contexts.push_back(std::make_unique<MirroredReplicaContext>(this, impl_.get(), static_cast<int>(r)));
  }
}

MirroredStrategy::~MirroredStrategy() = default;

std::string MirroredStrategy::name() const {
  std::string s = "MirroredStrategy(";
  for (size_t i = 0; i < impl_->devices.size(); ++i) s += (i ? ", " : "") + impl_->devices[i].to_string();
  return s + ")";
}

int MirroredStrategy::num_replicas_in_sync() const {
  return impl_->global_replicas ? impl_->global_replicas : static_cast<int>(impl_->devices.size());
}
std::vector<DeviceSpec> MirroredStrategy::worker_devices() const { return impl_->devices; }
CrossDeviceOps MirroredStrategy::cross_device_ops() const { return impl_->chosen; }

PerReplica MirroredStrategy::do_run(const ReplicaFn& fn, const PerReplica& inputs) {
  Impl& m = *impl_;
  const size_t n = m.devices.size();
  PerReplica out;
  out.values.resize(n);
  std::vector<std::exception_ptr> errors(n);
  std::vector<std::future<void>> done;
  for (size_t r = 0; r < n; ++r) {
    done.push_back(get_device(m.devices[r]).submit([&, r] {
      MirroredReplicaContext& ctx = *m.contexts[r];
      try {
        std::vector<Tensor> in;
        if (!inputs.values.empty())
          for (const auto& t : inputs.values[r]) in.push_back(t.defined() ? t.to(m.devices[r]) : t);
        detail::ReplicaThreadScope scope(this, &ctx);
        ctx.packer().reset();
        tape::GradientReadyHook* prev = tape::set_gradient_ready_hook(m.options.overlap_backward ? &ctx.packer() : nullptr);
        try {
          out.values[r] = fn(ctx, in);
        } catch (...) {
          tape::set_gradient_ready_hook(prev);
          throw;
        }
        tape::set_gradient_ready_hook(prev);
      } catch (...) {
        errors[r] = std::current_exception();
        // Wake the replicas waiting for this one in a collective.
        std::string what = "replica " + std::to_string(r) + " on " + m.devices[r].to_string() + " failed";
        try {
          std::rethrow_exception(errors[r]);
        } catch (const std::exception& e) {
          what += ": " + std::string(e.what());
        } catch (...) {
        }
        m.comms[r]->abort(what);
      }
    }));
  }
  for (auto& f : done) f.get();
  for (size_t r = 0; r < n; ++r) {
    if (!errors[r]) continue;
    // Rethrow the root cause (a replica whose own code failed) rather than an abort echo.
    size_t first = r;
    for (size_t q = 0; q < n; ++q) {
      if (!errors[q]) continue;
      try {
        std::rethrow_exception(errors[q]);
      } catch (const Unavailable&) {
      } catch (...) {
        first = q;
        break;
      }
    }
    for (auto& c : m.contexts) c->packer().reset();
    m.make_group();  // the aborted group is dead; the strategy stays usable
    std::rethrow_exception(errors[first]);
  }
  return out;
}

std::shared_ptr<Variable> MirroredStrategy::do_create_variable(const VariableSpec& spec) {
  return std::make_shared<MirroredVariable>(spec, this, impl_->devices, impl_->replica_offset);
}

PerReplica MirroredStrategy::do_split_batch(const std::vector<Tensor>& batch, int64_t global_batch) {
  const int n = static_cast<int>(impl_->devices.size());  // local replicas
  PerReplica out;
  out.values.resize(static_cast<size_t>(n));
  if (batch.empty()) return out;
  const int64_t rows = batch[0].shape()[0];
  const std::vector<int64_t> sizes = split_batch_sizes(rows, std::max(global_batch, rows), n);
  int64_t begin = 0;
  for (int r = 0; r < n; ++r) {
    const int64_t end = begin + sizes[static_cast<size_t>(r)];
    for (const auto& t : batch) {
      if (t.shape()[0] != rows)
        throw InvalidArgument("distribute_dataset: batch components have different leading dimensions");
      // Input batches are read-only: logical CPU devices share them without a copy.
      out.values[static_cast<size_t>(r)].push_back(t.slice_rows(begin, end).share_to(impl_->devices[static_cast<size_t>(r)]));
    }
    begin = end;
  }
  return out;
}

std::function<bool(PerReplica*)> MirroredStrategy::distribute_datasets_from_function(
    const std::function<Dataset(const InputContext&)>& fn) {
  const int n = static_cast<int>(impl_->devices.size());
  std::vector<std::shared_ptr<Dataset::Iterator>> its;
  for (int r = 0; r < n; ++r) {
    InputContext ic{n, r, n};
    its.push_back(fn(ic).make_iterator());
  }
  auto devices = impl_->devices;
  return [its, devices](PerReplica* out) {
    out->values.assign(its.size(), {});
    for (size_t r = 0; r < its.size(); ++r) {
      std::vector<Tensor> b;
      if (!its[r]->next(&b)) return false;
      for (auto& t : b) out->values[r].push_back(t.to(devices[r]));
    }
    return true;
  };
}

// --- CentralStorageStrategy ---

CentralStorageStrategy::CentralStorageStrategy(MirroredOptions compute, DeviceSpec parameter_device)
    : MirroredStrategy(std::move(compute)), parameter_device_(parameter_device) {
  get_device(parameter_device);
}

std::string CentralStorageStrategy::name() const {
  std::string s = MirroredStrategy::name();
  return "CentralStorageStrategy(compute=" + s.substr(s.find('(') + 1, s.size() - s.find('(') - 2) +
         ", parameters=" + parameter_device_.to_string() + ")";
}

std::shared_ptr<Variable> CentralStorageStrategy::do_create_variable(const VariableSpec& spec) {
  return std::make_shared<CentralVariable>(spec, this, parameter_device_, static_cast<size_t>(num_replicas_in_sync()));
}

}  // namespace dtrain
