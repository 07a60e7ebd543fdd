// The elastic rendezvous (dtrain/train/elastic.h): its server, hosted by dtrain-run, and the
// worker's Job, over the parameter servers' authenticated RPC (collectives/tcp/rpc.h).
//
// The RPC group is the rendezvous (rank 0) plus one slot per launcher id (rank 1 + id); the slots'
// addresses are never dialled, so they all repeat the rendezvous' address. Two methods:
//   kJoin  meta {i64 known generation, str my address} -> {i64 generation, i64 rank, i64 n, n x
//   (i64 id, str address)} kPoll  meta {i64 generation} -> {u8 changing}
#include <algorithm>
#include <condition_variable>
#include <cstdlib>
#include <map>
#include <mutex>
#include <set>

#include "collectives/tcp/rpc.h"
#include "dtrain/core/logging.h"
#include "dtrain/train/elastic.h"

namespace dtrain::elastic {
namespace {

using Clock = std::chrono::steady_clock;
constexpr uint16_t kJoin = 1, kPoll = 2;

TcpGroupOptions group_options(const std::string& rendezvous, const std::string& token, int rank) {
  TcpGroupOptions o;
  o.rank = rank;
  o.addresses.assign(1 + Job::kMaxWorkers, rendezvous);
  o.task_names.push_back("the elastic rendezvous");
  for (int i = 0; i < Job::kMaxWorkers; ++i)
    o.task_names.push_back("elastic worker " + std::to_string(i));
  o.token = token;
  return o;
}

std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::string(v) : std::string();
}

[[noreturn]] void missing(const char* name, const std::string& why) {
  throw InvalidArgument(
      std::string(name) + " " + why +
      "; an elastic worker is started by `dtrain-run --min-np N --max-np M -np K -- program`");
}

}  // namespace

// --- server ---

struct RendezvousServer::Impl {
  RendezvousOptions o;
  mutable std::mutex mu;
  std::condition_variable cv;
  int generation = 0;
  std::vector<int> members;                // the last round, in rank order
  std::map<int, std::string> member_addr;  // id -> address in the last round
  std::set<int> expected;                  // started, not yet heard from
  std::set<int> connected;                 // talking to us now
  std::map<int, std::string> waiting;      // id -> address, waiting for the next round
  Clock::time_point first_wait{};
  bool stopping = false;
  bool state_lost = false;  // every worker that held the job's state is gone
  std::unique_ptr<tcp::RpcServer> server;

  // Closes a round when its conditions hold (see elastic.h). Called with mu held.
  void try_close(Clock::time_point now) {
    if (waiting.empty() || static_cast<int>(waiting.size()) < o.min_np) return;
    bool all_here = expected.empty();
    for (int id : connected) all_here = all_here && waiting.count(id) != 0;
    if (!all_here && now < first_wait + o.settle) return;
    std::vector<int> order;
    for (int id : members)
      if (waiting.count(id)) order.push_back(id);
    if (generation > 0 && order.empty()) {
      // Only newcomers: a round without a survivor would start over from fresh weights. Wait while
      // a member of the running round is still connected (it will commit and come); with none left
      // the job's state is gone, and the waiting workers are told so (join answers the error).
      bool member_alive = false;
      for (int id : members) member_alive = member_alive || connected.count(id) != 0;
      if (member_alive) return;
      state_lost = true;
      cv.notify_all();
      return;
    }
    for (const auto& [id, addr] : waiting)
      if (std::find(order.begin(), order.end(), id) == order.end()) order.push_back(id);
    if (static_cast<int>(order.size()) > o.max_np) order.resize(static_cast<size_t>(o.max_np));
    ++generation;
    members = order;
    member_addr.clear();
    for (int id : order) {
      member_addr[id] = waiting[id];
      waiting.erase(id);
    }
    first_wait = now;
    std::string who;
    for (size_t r = 0; r < order.size(); ++r) who += (r ? ", " : "") + std::to_string(order[r]);
    DTRAIN_LOG(INFO) << "elastic rendezvous: round " << generation << " has " << order.size()
                     << " workers (ids " << who << ")";
    cv.notify_all();
  }

  void heard_from(int id) {
    expected.erase(id);
    connected.insert(id);
  }

  tcp::RpcMessage join(const tcp::RpcMessage& req, int id) {
    tcp::MetaReader r(req.meta, "elastic join from worker " + std::to_string(id));
    const int64_t known = r.i64();
    const std::string address = r.str();
    r.expect_end();
    std::unique_lock<std::mutex> lk(mu);
    heard_from(id);
    if (waiting.empty()) first_wait = Clock::now();
    waiting[id] = address;
    cv.notify_all();
    while (true) {
      try_close(Clock::now());
      if (generation > known && member_addr.count(id)) break;
      if (stopping)
        throw Unavailable("the elastic rendezvous is shutting down (the job is ending)");
      if (state_lost)
        throw FailedPrecondition(
            "every worker that held the elastic job's state has gone (none of round " +
            std::to_string(generation) +
            " is left); start the job again (with BackupAndRestore "
            "it resumes from its last backup)");
      if (!connected.count(id))
        throw Unavailable("elastic worker " + std::to_string(id) + " disconnected");
      cv.wait_for(lk, std::chrono::milliseconds(100));
    }
    tcp::MetaWriter w;
    const auto rank = std::find(members.begin(), members.end(), id) - members.begin();
    w.i64(generation).i64(rank).i64(static_cast<int64_t>(members.size()));
    for (int m : members) w.i64(m).str(member_addr[m]);
    return tcp::RpcMessage{kJoin, w.take(), {}};
  }

  tcp::RpcMessage poll(const tcp::RpcMessage& req, int id) {
    tcp::MetaReader r(req.meta, "elastic poll from worker " + std::to_string(id));
    const int64_t gen = r.i64();
    r.expect_end();
    std::lock_guard<std::mutex> lk(mu);
    heard_from(id);
    // A started worker counts once it has arrived (waiting): one that never connects (a host that
    // is cut off) must not interrupt training again and again.
    bool changing = gen != generation || !waiting.empty();
    for (int m : members) changing = changing || connected.count(m) == 0;
    tcp::MetaWriter w;
    w.u8(changing ? 1 : 0);
    return tcp::RpcMessage{kPoll, w.take(), {}};
  }
};

RendezvousServer::RendezvousServer(RendezvousOptions options) : impl_(std::make_unique<Impl>()) {
  if (options.min_np < 1 || options.max_np < options.min_np || options.max_np > Job::kMaxWorkers)
    throw InvalidArgument(
        "elastic rendezvous: need 1 <= min_np <= max_np <= " + std::to_string(Job::kMaxWorkers) +
        ", got " + std::to_string(options.min_np) + " and " + std::to_string(options.max_np));
  impl_->o = options;
  Impl* m = impl_.get();
  impl_->server = std::make_unique<tcp::RpcServer>(
      group_options(options.address, options.token, 0),
      [m](const tcp::RpcMessage& req, int client) -> tcp::RpcMessage {
        const int id = client - 1;
        if (req.method == kJoin) return m->join(req, id);
        if (req.method == kPoll) return m->poll(req, id);
        throw InvalidArgument("elastic rendezvous: unknown method " + std::to_string(req.method));
      },
      [m](int client) {
        std::lock_guard<std::mutex> lk(m->mu);
        m->connected.erase(client - 1);
        m->waiting.erase(client - 1);
        m->cv.notify_all();
      });
}

RendezvousServer::~RendezvousServer() {
  {
    std::lock_guard<std::mutex> lk(impl_->mu);
    impl_->stopping = true;
    impl_->cv.notify_all();
  }
  impl_->server->stop();
}

void RendezvousServer::expect(int id) {
  std::lock_guard<std::mutex> lk(impl_->mu);
  impl_->expected.insert(id);
  impl_->cv.notify_all();
}

void RendezvousServer::lost(int id) {
  std::lock_guard<std::mutex> lk(impl_->mu);
  impl_->expected.erase(id);
  impl_->connected.erase(id);
  impl_->waiting.erase(id);
  impl_->cv.notify_all();
}

int RendezvousServer::generation() const {
  std::lock_guard<std::mutex> lk(impl_->mu);
  return impl_->generation;
}

int RendezvousServer::workers() const {
  std::lock_guard<std::mutex> lk(impl_->mu);
  return static_cast<int>(impl_->members.size());
}

std::vector<int> RendezvousServer::members() const {
  std::lock_guard<std::mutex> lk(impl_->mu);
  return impl_->members;
}

// --- worker ---

struct Job::Impl {
  TcpGroupOptions o;
  std::string address;
  std::string token;
  std::unique_ptr<tcp::RpcClient> client;
};

bool Job::in_elastic_job() { return !env("DTRAIN_ELASTIC_RENDEZVOUS").empty(); }

Job::Job() : impl_(std::make_unique<Impl>()) {
  const std::string rdzv = env("DTRAIN_ELASTIC_RENDEZVOUS");
  if (rdzv.empty()) missing("DTRAIN_ELASTIC_RENDEZVOUS", "is not set");
  const std::string id = env("DTRAIN_ELASTIC_ID");
  try {
    size_t used = 0;
    id_ = std::stoi(id, &used);
    if (used != id.size() || id_ < 0 || id_ >= kMaxWorkers) throw std::out_of_range(id);
  } catch (const std::exception&) {
    missing("DTRAIN_ELASTIC_ID",
            "must be a number in [0, " + std::to_string(kMaxWorkers) + "), got '" + id + "'");
  }
  impl_->address = env("DTRAIN_ELASTIC_ADDRESS");
  if (impl_->address.find(':') == std::string::npos)
    missing("DTRAIN_ELASTIC_ADDRESS",
            "must be this worker's host:port, got '" + impl_->address + "'");
  impl_->token = env("DTRAIN_JOB_TOKEN");
  if (impl_->token.empty()) missing("DTRAIN_JOB_TOKEN", "is not set");
  std::chrono::seconds timeout(300);
  if (const std::string t = env("DTRAIN_ELASTIC_TIMEOUT"); !t.empty()) {
    try {
      timeout = std::chrono::seconds(std::max(1, std::stoi(t)));
    } catch (const std::exception&) {
      missing("DTRAIN_ELASTIC_TIMEOUT", "must be a number of seconds, got '" + t + "'");
    }
  }
  impl_->o = group_options(rdzv, impl_->token, 1 + id_);
  impl_->o.connect_timeout = std::chrono::seconds(60);
  impl_->o.collective.timeout = timeout;
  impl_->client = std::make_unique<tcp::RpcClient>(impl_->o, 0);
}

Job::~Job() = default;

ClusterResolution Job::join() {
  tcp::MetaWriter w;
  w.i64(membership_.generation).str(impl_->address);
  tcp::RpcMessage resp;
  try {
    resp = impl_->client->call(tcp::RpcMessage{kJoin, w.take(), {}});
  } catch (const DeadlineExceeded& e) {
    throw DeadlineExceeded("elastic worker " + std::to_string(id_) +
                           ": no round of at least --min-np workers formed within " +
                           std::to_string(impl_->o.collective.timeout.count() / 1000) +
                           " s (DTRAIN_ELASTIC_TIMEOUT); too few workers are left: " + e.what());
  }
  tcp::MetaReader r(resp.meta, "elastic join answer");
  Membership m;
  m.generation = static_cast<int>(r.i64());
  m.rank = static_cast<int>(r.i64());
  const int64_t n = r.i64();
  if (n < 1 || n > kMaxWorkers || m.rank < 0 || m.rank >= n)
    throw DataLoss("elastic join answer: rank " + std::to_string(m.rank) + " of " +
                   std::to_string(n) + " workers");
  for (int64_t i = 0; i < n; ++i) {
    m.ids.push_back(static_cast<int>(r.i64()));
    m.addresses.push_back(r.str());
  }
  r.expect_end();
  membership_ = m;
  ClusterSpec spec(ClusterSpec::JobMap{{TaskType::kWorker, m.addresses}});
  return ClusterResolution(spec, TaskType::kWorker, m.rank,
                           "elastic rendezvous round " + std::to_string(m.generation));
}

std::string Job::token() const {
  if (membership_.generation == 0)
    throw FailedPrecondition(
        "elastic::Job::token(): call join() first (the token belongs to a round)");
  return impl_->token + "/elastic-round-" + std::to_string(membership_.generation);
}

bool Job::membership_changing() {
  tcp::MetaWriter w;
  w.i64(membership_.generation);
  const tcp::RpcMessage resp = impl_->client->call(tcp::RpcMessage{kPoll, w.take(), {}});
  tcp::MetaReader r(resp.meta, "elastic poll answer");
  const bool changing = r.u8() != 0;
  r.expect_end();
  return changing;
}

}  // namespace dtrain::elastic
