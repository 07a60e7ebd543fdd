#include "dtrain/strategies/mirrored_strategy.h"

#include <algorithm>
#include <exception>

#include "dtrain/collectives/inproc.h"
#include "dtrain/core/logging.h"
#include "dtrain/core/timeline.h"
#include "dtrain/data/dataset.h"
#include "dtrain/devices/device.h"
#include "strategies/mirrored_impl.h"
#include "strategies/mirrored_variables.h"
#include "strategies/replica_scope.h"

namespace dtrain {

const char* cross_device_ops_name(CrossDeviceOps ops) {
  switch (ops) {
    case CrossDeviceOps::kAuto:
      return "auto";
    case CrossDeviceOps::kInproc:
      return "inproc";
    case CrossDeviceOps::kNccl:
      return "nccl";
    case CrossDeviceOps::kReduceToOneDevice:
      return "reduce_to_one_device";
  }
  return "?";
}

const char* sharding_name(Sharding s) {
  switch (s) {
    case Sharding::kNone:
      return "none";
    case Sharding::kOptimizerState:
      return "optimizer_state (ZeRO-1)";
    case Sharding::kGradients:
      return "gradients (ZeRO-2)";
    case Sharding::kParameters:
      return "parameters (ZeRO-3)";
  }
  return "?";
}

Sharding parse_sharding(const std::string& name) {
  if (name == "none" || name == "0") return Sharding::kNone;
  if (name == "optimizer_state" || name == "1") return Sharding::kOptimizerState;
  if (name == "gradients" || name == "2") return Sharding::kGradients;
  if (name == "parameters" || name == "3") return Sharding::kParameters;
  throw InvalidArgument("sharding '" + name +
                        "': valid values are none (0), optimizer_state (1: ZeRO-1), gradients "
                        "(2: ZeRO-2) and parameters (3: ZeRO-3)");
}

size_t auto_bytes_per_pack(int workers) {
  constexpr size_t kPerWorker = size_t{512} << 10, kLeast = size_t{4} << 20,
                   kMost = size_t{64} << 20;
  return std::clamp(static_cast<size_t>(std::max(workers, 1)) * kPerWorker, kLeast, kMost);
}

void MirroredStrategy::Impl::span_workers(const StrategyExtended& parts) {
  const int local = static_cast<int>(devices.size());
  cross = parts.shared_cross_worker();
  replica_offset = cross ? parts.worker_rank() * local : 0;
  global_replicas = cross ? parts.num_workers() * local : local;
  const int workers = cross ? parts.num_workers() : 1;
  const size_t before = pack_bytes;
  if (!options.bytes_per_pack)
    pack_bytes = auto_bytes_per_pack(workers);
  else
    pack_bytes = *options.bytes_per_pack == 0 ? ~size_t{0} : *options.bytes_per_pack;
  if (!options.bytes_per_pack && pack_bytes != before) {
    DTRAIN_LOG(INFO) << "gradient packs of " << (pack_bytes >> 10) << " KiB for " << workers
                     << " workers (MirroredOptions::bytes_per_pack or DTRAIN_BYTES_PER_PACK sets "
                        "it)";
  }
}

void MirroredStrategy::Impl::drain_comm_threads() {
  std::vector<std::future<void>> idle;
  for (auto& t : comm_threads) idle.push_back(t->submit([] {}));
  for (auto& f : idle) f.get();
}

void MirroredStrategy::Impl::make_group() {
  CollectiveOptions co;
  co.timeout = options.timeout;
  // Built aside, then swapped in: a group that fails to build leaves no half-made one behind.
  auto group = make_cross_device_group(devices, options.cross_device_ops, co, &chosen);
  if (cross)
    for (auto& c : group) c = cross->span_workers(std::move(c), static_cast<int>(devices.size()));
  comms = std::move(group);
}

std::vector<DeviceSpec> mirrored_devices(const MirroredOptions& options) {
  std::vector<DeviceSpec> devices = options.devices;
  if (devices.empty()) {
    devices = list_devices(DeviceType::kCUDA);
    if (devices.empty()) devices = {DeviceSpec::cpu(0)};
  }
  for (size_t i = 0; i < devices.size(); ++i) {
    get_device(devices[i]);  // fails now, listing what exists
    for (size_t j = 0; j < i; ++j)
      if (devices[i] == devices[j])
        throw InvalidArgument(
            "MirroredStrategy: device " + devices[i].to_string() +
            " is listed twice; each replica needs its own device (use --devices=cpu:N)");
  }
  return devices;
}

MirroredStrategy::MirroredStrategy(MirroredOptions options)
    : MirroredStrategy(std::move(options), StrategyExtended()) {}

MirroredStrategy::MirroredStrategy(MirroredOptions options, StrategyExtended parts)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.options = options;
  m.devices = mirrored_devices(options);
  m.span_workers(parts);
  bool all_host = true;
  for (const auto& d : m.devices) all_host = all_host && d.type == DeviceType::kCPU;
  // Multi-worker jobs keep a copy per replica: their sums come from other processes too.
  m.shared_variables = options.share_host_variables && all_host && m.devices.size() > 1 &&
                       !m.cross && options.sharding == Sharding::kNone;
  if (options.sharding != Sharding::kNone) {
    DTRAIN_LOG(INFO) << "sharding " << sharding_name(options.sharding) << " over "
                     << m.global_replicas << " replicas";
  }
  assemble(std::move(parts));
  m.make_group();
  if (options.sharding == Sharding::kParameters)
    m.params = std::make_shared<ShardedParameters>(this, impl_.get());
  m.exchange.resize(m.devices.size());
  for (size_t r = 0; r < m.devices.size(); ++r) {
    const std::string comm_name =
        m.devices[r].to_string() + " replica " + std::to_string(r) + " collectives";
    m.comm_threads.push_back(
        std::make_unique<WorkerThread>([comm_name] { timeline::set_thread_name(comm_name); }));
    m.contexts.push_back(
        std::make_unique<MirroredReplicaContext>(this, impl_.get(), static_cast<int>(r)));
  }
}

void MirroredStrategy::reassemble(const std::function<StrategyExtended()>& connect) {
  Impl& m = *impl_;
  const AutoShardPolicy shard = extended().auto_shard_policy();
  // The old communicators go first: their cross-worker connections close before new ones open.
  m.drain_comm_threads();
  for (auto& c : m.contexts) c->packer().reset();
  if (m.params) m.params->reset();  // prefetches and order belong to the old group
  m.comms.clear();
  m.cross.reset();
  assemble(StrategyExtended());
  StrategyExtended parts = connect();
  DTRAIN_CHECK(parts.cross_worker() != nullptr, "reassemble needs a cross-worker part");
  DTRAIN_CHECK(!m.shared_variables,
               "a strategy whose replicas share variables has no workers to reassemble");
  m.span_workers(parts);
  assemble(std::move(parts));
  extended().set_auto_shard_policy(shard);
  m.make_group();
}

Sharding MirroredStrategy::sharding() const { return impl_->options.sharding; }

size_t MirroredStrategy::bytes_per_pack() const { return impl_->pack_bytes; }

std::optional<UpdatePartition> MirroredStrategy::update_partition() const {
  const Impl& m = *impl_;
  if (m.options.sharding == Sharding::kNone) return std::nullopt;
  UpdatePartition p;
  p.num_parts = m.global_replicas;
  for (size_t r = 0; r < m.devices.size(); ++r) {
    p.local_parts.push_back(m.replica_offset + static_cast<int>(r));
    p.devices.push_back(m.devices[r]);
  }
  return p;
}

void MirroredStrategy::set_broadcast_initial_values(bool on) { impl_->broadcast_initial = on; }
bool MirroredStrategy::broadcast_initial_values() const { return impl_->broadcast_initial; }

MirroredStrategy::~MirroredStrategy() {
  // What is queued on the communication threads (gradient packs, ZeRO-3 prefetches) uses the
  // replica contexts, which the members' order would free first.
  if (impl_) impl_->drain_comm_threads();
}

std::string MirroredStrategy::name() const {
  std::string s = "MirroredStrategy(";
  for (size_t i = 0; i < impl_->devices.size(); ++i)
    s += (i ? ", " : "") + impl_->devices[i].to_string();
  return s + ")";
}

int MirroredStrategy::num_replicas_in_sync() const { return impl_->global_replicas; }
std::vector<DeviceSpec> MirroredStrategy::worker_devices() const { return impl_->devices; }
CrossDeviceOps MirroredStrategy::cross_device_ops() const { return impl_->chosen; }

PerReplica MirroredStrategy::do_run(const ReplicaFn& fn, const PerReplica& inputs) {
  Impl& m = *impl_;
  const size_t n = m.devices.size();
  if (m.comms.size() != n)
    throw FailedPrecondition(
        "MirroredStrategy::run: the strategy has no communicators: the last reassemble() failed "
        "to connect, or remaking the group after a failed step failed (the error, or a warning in "
        "the log, said why); reassemble again, or build a new strategy");
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
        ctx.end_interrupted_update();
        tape::GradientReadyHook* prev =
            tape::set_gradient_ready_hook(m.options.overlap_backward ? &ctx.packer() : nullptr);
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
        std::string what =
            "replica " + std::to_string(r) + " on " + m.devices[r].to_string() + " failed";
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
    // Gradient packs the backward pass launched may still be queued on the communication
    // threads: with every communicator aborted they fail at once, and they must be done before
    // the group is replaced (a pack running after it would take the new group's communicator,
    // or one being freed: a collective out of step with the other workers, a hang or a crash).
    for (size_t q = 0; q < n; ++q)
      if (!errors[q]) m.comms[q]->abort("replica " + std::to_string(first) + " failed");
    m.drain_comm_threads();
    for (auto& c : m.contexts) c->packer().reset();
    if (m.params) m.params->reset();
    try {
      m.make_group();  // the aborted group is dead; the strategy stays usable
    } catch (const std::exception& e) {
      // The step's error is the one to report; the next step says the group is missing.
      DTRAIN_LOG(WARNING) << "remaking the collective group after a failed step failed: "
                          << e.what();
      m.comms.clear();
    }
    std::rethrow_exception(errors[first]);
  }
  return out;
}

std::shared_ptr<Variable> MirroredStrategy::do_create_variable(const VariableSpec& spec) {
  const bool shared =
      impl_->shared_variables && spec.synchronization != VariableSynchronization::kOnRead;
  std::shared_ptr<ParameterGatherer> gatherer;
  if (impl_->params && spec.trainable && spec.synchronization != VariableSynchronization::kOnRead &&
      spec.dtype == DType::kFloat32)
    gatherer = impl_->params;
  auto v = std::make_shared<MirroredVariable>(spec, this, impl_->devices, shared, gatherer);
  if (impl_->cross && impl_->cross->num_workers() > 1 &&
      impl_->broadcast_initial) {  // every worker starts from the chief's values
    Tensor h = v->device_values()[0].to(DeviceSpec::cpu()).clone();
    impl_->cross->broadcast_from_chief(h);
    for (Tensor copy : v->device_values())
      copy.copy_from(h);  // handles alias the variable's memory
  }
  return v;
}

std::optional<std::pair<int64_t, int64_t>> MirroredStrategy::do_input_rows(
    int64_t global_batch) const {
  const Impl& m = *impl_;
  if (!m.cross || m.cross->num_workers() < 2 || global_batch <= 0 ||
      extended().auto_shard_policy() == AutoShardPolicy::kOff)
    return std::nullopt;
  // DATA: replica k of the job takes the k-th run of rows (split_batch_sizes); this worker's
  // replicas are consecutive, so its rows are one range. A short last batch fills replicas in
  // order, so the range stays right for it (cut at its end).
  const std::vector<int64_t> sizes =
      split_batch_sizes(global_batch, global_batch, m.global_replicas);
  int64_t first = 0, last = 0;
  for (int r = 0; r < m.replica_offset + static_cast<int>(m.devices.size()); ++r) {
    if (r < m.replica_offset) first += sizes[static_cast<size_t>(r)];
    last += sizes[static_cast<size_t>(r)];
  }
  return std::make_pair(first, last);
}

PerReplica MirroredStrategy::do_split_batch(const std::vector<Tensor>& batch, int64_t global_batch,
                                            const BatchRows& where) {
  Impl& m = *impl_;
  const int local = static_cast<int>(m.devices.size());
  const bool off = m.cross && extended().auto_shard_policy() == AutoShardPolicy::kOff;
  PerReplica out;
  out.values.resize(static_cast<size_t>(local));
  const int64_t held = batch.empty() ? 0 : batch[0].shape()[0];
  for (const auto& t : batch)
    if (t.shape()[0] != held)
      throw InvalidArgument(
          "distribute_dataset: batch components have different leading dimensions");
  // The rows of the whole global batch; `batch` holds rows [where.first, where.first + held) of it.
  const int64_t rows = where.total < 0 ? held : where.total;
  // One worker, or OFF: this worker's batch is split over its replicas. DATA (multi-worker): every
  // worker reads the same global batch and keeps its own replicas' rows.
  const int total = off ? local : m.global_replicas;
  const int first = off ? 0 : m.replica_offset;
  std::vector<int64_t> sizes = split_batch_sizes(rows, std::max(global_batch, rows), total);
  int64_t begin = 0;
  for (int r = 0; r < first; ++r) begin += sizes[static_cast<size_t>(r)];
  begin -= where.first;
  // A window whose reader skipped rows (ignore_errors) holds fewer than its replicas' share: what
  // it holds is split over them. The step's row count stays the planned one on every worker (they
  // cannot know of each other's skips before the step, and the epoch's loss, which callbacks
  // decide on, must be the same everywhere): that step's mean is a few rows low.
  if (where.total >= 0) {
    int64_t want = 0;
    for (int r = 0; r < local; ++r) want += sizes[static_cast<size_t>(first + r)];
    if (held < want && begin == 0) {
      const std::vector<int64_t> mine = split_batch_sizes(held, want, local);
      for (int r = 0; r < local; ++r)
        sizes[static_cast<size_t>(first + r)] = mine[static_cast<size_t>(r)];
    }
  }
  for (int r = 0; r < local; ++r) {
    const int64_t n = sizes[static_cast<size_t>(first + r)];
    if (n == 0) {  // past the end of a short batch (where the pipeline's window may start later)
      for (const auto& t : batch)
        out.values[static_cast<size_t>(r)].push_back(
            t.slice_rows(0, 0).share_to(m.devices[static_cast<size_t>(r)]));
      continue;
    }
    if (begin < 0 || begin + n > held)
      throw Internal("distribute_dataset: replica " + std::to_string(first + r) + " needs rows [" +
                     std::to_string(begin + where.first) + ", " +
                     std::to_string(begin + where.first + n) +
                     ") of the global batch, but the input pipeline gave rows [" +
                     std::to_string(where.first) + ", " + std::to_string(where.first + held) + ")");
    // Input batches are read-only: logical CPU devices share them without a copy.
    for (const auto& t : batch)
      out.values[static_cast<size_t>(r)].push_back(
          t.slice_rows(begin, begin + n).share_to(m.devices[static_cast<size_t>(r)]));
    begin += n;
  }
  if (batch.empty()) out.values.assign(static_cast<size_t>(local), {});
  out.global_rows =
      off ? static_cast<int64_t>(extended().sum_across_workers({static_cast<double>(rows)})[0])
          : rows;
  return out;
}

// --- CentralStorageStrategy ---

namespace {
MirroredOptions central_compute(MirroredOptions o) {
  if (o.sharding != Sharding::kNone)
    throw InvalidArgument(
        "CentralStorageStrategy keeps one copy of each variable and updates it once; sharding "
        "(ZeRO) is an option of MirroredStrategy and MultiWorkerMirroredStrategy");
  o.share_host_variables =
      false;  // its variables are central; the replicas all-reduce to update them
  return o;
}
}  // namespace

CentralStorageStrategy::CentralStorageStrategy(MirroredOptions compute, DeviceSpec parameter_device)
    : MirroredStrategy(central_compute(std::move(compute))), parameter_device_(parameter_device) {
  get_device(parameter_device);
}

std::string CentralStorageStrategy::name() const {
  std::string s = MirroredStrategy::name();
  return "CentralStorageStrategy(compute=" + s.substr(s.find('(') + 1, s.size() - s.find('(') - 2) +
         ", parameters=" + parameter_device_.to_string() + ")";
}

std::shared_ptr<Variable> CentralStorageStrategy::do_create_variable(const VariableSpec& spec) {
  return std::make_shared<CentralVariable>(spec, this, parameter_device_,
                                           static_cast<size_t>(num_replicas_in_sync()));
}

}  // namespace dtrain
