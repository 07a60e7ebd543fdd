#include "collectives/tcp/rpc.h"

#include <linux/sockios.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "collectives/tcp/auth.h"
#include "collectives/tcp/mesh.h"
#include "collectives/tcp/tcp_environment.h"
#include "dtrain/core/logging.h"

namespace dtrain::tcp {
namespace {

constexpr uint64_t kMaxTensors = 1 << 16;
constexpr int kMaxRank = 8;

enum Status : uint8_t {
  kOk = 0,
  kInvalidArgument,
  kFailedPrecondition,
  kUnavailable,
  kDeadlineExceeded,
  kDataLoss,
  kPermissionDenied,
  kNotFound,
  kUnimplemented,
  kInternal
};

uint8_t status_of(const Error& e) {
  if (dynamic_cast<const InvalidArgument*>(&e)) return kInvalidArgument;
  if (dynamic_cast<const FailedPrecondition*>(&e)) return kFailedPrecondition;
  if (dynamic_cast<const Unavailable*>(&e)) return kUnavailable;
  if (dynamic_cast<const DeadlineExceeded*>(&e)) return kDeadlineExceeded;
  if (dynamic_cast<const DataLoss*>(&e)) return kDataLoss;
  if (dynamic_cast<const PermissionDenied*>(&e)) return kPermissionDenied;
  if (dynamic_cast<const NotFound*>(&e)) return kNotFound;
  if (dynamic_cast<const Unimplemented*>(&e)) return kUnimplemented;
  return kInternal;
}

// The server's message without its "Name: " prefix (the rethrown error adds it back).
std::string strip_prefix(const std::string& m) {
  const auto colon = m.find(": ");
  return colon != std::string::npos && colon < 24 && m.find(' ') > colon ? m.substr(colon + 2) : m;
}

[[noreturn]] void rethrow(uint8_t status, const std::string& msg) {
  switch (status) {
    case kInvalidArgument:
      throw InvalidArgument(msg);
    case kFailedPrecondition:
      throw FailedPrecondition(msg);
    case kUnavailable:
      throw Unavailable(msg);
    case kDeadlineExceeded:
      throw DeadlineExceeded(msg);
    case kDataLoss:
      throw DataLoss(msg);
    case kPermissionDenied:
      throw PermissionDenied(msg);
    case kNotFound:
      throw NotFound(msg);
    case kUnimplemented:
      throw Unimplemented(msg);
    default:
      throw Internal(msg);
  }
}

}  // namespace

MetaWriter& MetaWriter::raw(const void* p, size_t n) {
  out_.append(static_cast<const char*>(p), n);
  return *this;
}

MetaWriter& MetaWriter::str(const std::string& s) {
  u64(s.size());
  out_ += s;
  return *this;
}

void MetaReader::need(size_t n) const {
  if (s_.size() - pos_ < n)
    throw DataLoss(detail::str_cat("malformed ", what_, ": its fields end after ", s_.size(),
                                   " bytes; is every task running the same dtrain build?"));
}

uint64_t MetaReader::u64() {
  need(8);
  uint64_t v;
  std::memcpy(&v, s_.data() + pos_, 8);
  pos_ += 8;
  return v;
}

int64_t MetaReader::i64() { return static_cast<int64_t>(u64()); }

uint8_t MetaReader::u8() {
  need(1);
  return static_cast<uint8_t>(s_[pos_++]);
}

std::string MetaReader::str(size_t max_len) {
  const uint64_t n = u64();
  if (n > max_len)
    throw DataLoss(
        detail::str_cat("malformed ", what_, ": a string of ", n, " bytes (limit ", max_len, ")"));
  need(n);
  std::string out = s_.substr(pos_, n);
  pos_ += n;
  return out;
}

void MetaReader::expect_end() const {
  if (pos_ != s_.size())
    throw DataLoss(
        detail::str_cat("malformed ", what_, ": ", s_.size() - pos_, " unexpected trailing bytes"));
}

void write_message(const Peer& peer, FrameKind kind, uint64_t id, uint32_t sender, uint8_t status,
                   const RpcMessage& m, Clock::time_point deadline) {
  std::string prefix(sizeof(FrameHeader), '\0');
  const uint32_t meta_len = static_cast<uint32_t>(m.meta.size());
  prefix.append(reinterpret_cast<const char*>(&meta_len), 4);
  prefix += m.meta;
  size_t data = 0;
  for (const Tensor& t : m.tensors) {
    DTRAIN_CHECK(t.defined() && t.device().host_accessible(),
                 "rpc tensors must be defined CPU tensors");
    prefix.push_back(static_cast<char>(t.dtype()));
    prefix.push_back(static_cast<char>(t.rank()));
    for (int64_t d : t.shape().dims()) prefix.append(reinterpret_cast<const char*>(&d), 8);
    data += t.nbytes();
  }
  FrameHeader h;
  h.kind = static_cast<uint16_t>(kind);
  h.seq = id;
  h.op = m.method;
  h.reduce = status;
  h.sender = sender;
  h.count = m.tensors.size();
  h.payload_bytes = prefix.size() - sizeof(FrameHeader) + data;
  std::memcpy(prefix.data(), &h, sizeof(h));
  if (data <= (64u << 10)) {  // small: one send
    for (const Tensor& t : m.tensors)
      prefix.append(static_cast<const char*>(t.raw_data()), t.nbytes());
    write_exact(peer, prefix.data(), prefix.size(), deadline);
    return;
  }
  write_exact(peer, prefix.data(), prefix.size(), deadline);
  for (const Tensor& t : m.tensors) write_exact(peer, t.raw_data(), t.nbytes(), deadline);
}

RpcMessage read_message_body(const Peer& peer, const FrameHeader& h, Clock::time_point deadline,
                             const std::vector<Tensor>* into) {
  const std::string what =
      std::string(h.kind == static_cast<uint16_t>(FrameKind::kRequest) ? "request" : "response") +
      " from " + peer.name;
  uint64_t left = h.payload_bytes;
  auto take = [&](uint64_t n) {
    if (n > left)
      throw DataLoss(detail::str_cat("malformed ", what, " (", peer.address,
                                     "): its parts need more than the ", h.payload_bytes,
                                     " payload bytes the header announced"));
    left -= n;
  };
  if (h.count > kMaxTensors)
    throw DataLoss(
        detail::str_cat("malformed ", what, ": ", h.count, " tensors (limit ", kMaxTensors, ")"));
  RpcMessage m;
  m.method = h.op;
  uint32_t meta_len = 0;
  take(4);
  read_exact(peer, &meta_len, 4, deadline);
  take(meta_len);
  m.meta.resize(meta_len);
  read_exact(peer, m.meta.data(), meta_len, deadline);
  std::vector<std::pair<DType, Shape>> specs;
  for (uint64_t i = 0; i < h.count; ++i) {
    uint8_t dr[2];
    take(2);
    read_exact(peer, dr, 2, deadline);
    if (dr[0] > static_cast<uint8_t>(DType::kInt64) || dr[1] > kMaxRank)
      throw DataLoss(detail::str_cat("malformed ", what, ": tensor ", i, " has dtype code ",
                                     int(dr[0]), " and rank ", int(dr[1])));
    std::vector<int64_t> dims(dr[1]);
    take(8ull * dr[1]);
    read_exact(peer, dims.data(), 8ull * dr[1], deadline);
    uint64_t numel = 1;
    for (int64_t d : dims) {
      if (d < 0 || (d > 0 && numel > left / static_cast<uint64_t>(d)))
        throw DataLoss(detail::str_cat("malformed ", what, ": tensor ", i,
                                       " has a bad or oversized dimension ", d));
      numel *= static_cast<uint64_t>(d);
    }
    specs.emplace_back(static_cast<DType>(dr[0]), Shape(dims));
  }
  for (size_t i = 0; i < specs.size(); ++i) {
    const auto& [dtype, shape] = specs[i];
    const uint64_t n = static_cast<uint64_t>(shape.numel()) * dtype_size(dtype);
    take(n);
    const bool direct = into && i < into->size() && (*into)[i].defined() &&
                        (*into)[i].shape() == shape && (*into)[i].dtype() == dtype &&
                        (*into)[i].device().host_accessible();
    Tensor t = direct ? (*into)[i] : Tensor::empty(shape, dtype);
    if (n) read_exact(peer, t.raw_data(), n, deadline);
    m.tensors.push_back(std::move(t));
  }
  if (left != 0)
    throw DataLoss(detail::str_cat("malformed ", what, ": ", left,
                                   " payload bytes left over after its parts"));
  return m;
}

// ---------------------------------------------------------------------------------------------
// Server

RpcServer::RpcServer(TcpGroupOptions options, RpcHandler handler, RpcDisconnect on_disconnect)
    : o_(tcp::apply_tcp_environment(std::move(options))),
      fingerprint_(job_fingerprint(o_.addresses)),
      handler_(std::move(handler)),
      on_disconnect_(std::move(on_disconnect)) {
  if (o_.rank < 0 || o_.rank >= static_cast<int>(o_.addresses.size()))
    throw InvalidArgument(
        detail::str_cat("rank ", o_.rank, " out of range for ", o_.addresses.size(), " addresses"));
  if (o_.token.size() < 16)
    throw InvalidArgument(
        "the job token must be at least 16 characters; set DTRAIN_JOB_TOKEN (dtrain-run generates "
        "one)");
  listen_fd_ = open_listener(o_.addresses[static_cast<size_t>(o_.rank)], name_of(o_, o_.rank));
  acceptor_ = std::thread([this] { accept_loop(); });
  heartbeat_ = std::thread([this] { heartbeat_loop(); });
}

void RpcServer::heartbeat_loop() {
  FrameHeader h;
  h.kind = static_cast<uint16_t>(FrameKind::kHeartbeat);
  h.sender = static_cast<uint32_t>(o_.rank);
  std::unique_lock<std::mutex> lock(mu_);
  while (!hb_cv_.wait_for(lock, o_.heartbeat_interval, [this] { return stopping_.load(); })) {
    const std::vector<std::shared_ptr<Live>> conns = live_conns_;
    lock.unlock();
    for (const auto& c : conns) {
      std::unique_lock<std::mutex> send(c->send_mu, std::try_to_lock);
      if (!send.owns_lock() || c->fd < 0) continue;  // an answer is going out: traffic enough
      int queued = 0;
      if (::ioctl(c->fd, SIOCOUTQ, &queued) == 0 && queued > (1 << 20))
        continue;  // a big answer still draining: it is traffic enough, and the socket may be full
      const ssize_t w = ::send(c->fd, &h, sizeof(h), MSG_NOSIGNAL | MSG_DONTWAIT);
      // A full socket skips one. Part of a header would have the client read the next answer's
      // bytes as its rest: end the connection instead (the client fails on it, naming this task).
      if (w > 0 && static_cast<size_t>(w) < sizeof(h)) ::shutdown(c->fd, SHUT_RDWR);
    }
    lock.lock();
  }
}

RpcServer::~RpcServer() { stop(); }

void RpcServer::stop() {
  if (stopping_.exchange(true)) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    hb_cv_.notify_all();
  }
  if (heartbeat_.joinable()) heartbeat_.join();
  if (acceptor_.joinable()) acceptor_.join();
  std::vector<Connection> threads;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (int fd : fds_) ::shutdown(fd, SHUT_RDWR);
    threads.swap(threads_);
  }
  for (auto& c : threads) c.thread.join();
  if (listen_fd_ >= 0) ::close(listen_fd_);
  listen_fd_ = -1;
}

void RpcServer::accept_loop() {
  while (!stopping_.load()) {
    pollfd pfd{listen_fd_, POLLIN, 0};
    if (::poll(&pfd, 1, 100) <= 0) continue;
    sockaddr_storage addr{};
    socklen_t len = sizeof(addr);
    const int fd = ::accept4(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len, SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EMFILE || errno == ENFILE ||
          errno == ENOMEM) {  // out of descriptors: back off, say so
        DTRAIN_LOG(WARNING) << name_of(o_, o_.rank)
                            << " cannot accept connections: " << std::strerror(errno);
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
      }
      continue;
    }
    char host[NI_MAXHOST] = "?", serv[NI_MAXSERV] = "?";
    ::getnameinfo(reinterpret_cast<sockaddr*>(&addr), len, host, sizeof(host), serv, sizeof(serv),
                  NI_NUMERICHOST | NI_NUMERICSERV);
    Peer p;
    p.fd = fd;
    p.address = std::string(host) + ":" + serv;
    p.name = p.address;
    set_nonblocking(fd);
    set_socket_options(fd);
    set_keepalive(fd);
    std::lock_guard<std::mutex> lock(mu_);
    // Join the threads of connections that have ended (workers come and go for days).
    for (size_t i = 0; i < threads_.size();) {
      if (threads_[i].finished->load()) {
        threads_[i].thread.join();
        threads_[i] = std::move(threads_.back());
        threads_.pop_back();
      } else {
        ++i;
      }
    }
    fds_.push_back(fd);
    ++live_;
    auto finished = std::make_shared<std::atomic<bool>>(false);
    try {
      threads_.push_back(
          Connection{std::thread([this, p, finished] { serve(p, finished); }), finished});
    } catch (const std::exception& e) {  // no thread for it: refuse the connection, keep serving
      DTRAIN_LOG(WARNING) << name_of(o_, o_.rank)
                          << " cannot serve another connection: " << e.what();
      fds_.pop_back();
      --live_;
      ::close(fd);
    }
  }
}

void RpcServer::serve(Peer p, std::shared_ptr<std::atomic<bool>> finished) {
  bool authenticated = false;
  std::shared_ptr<Live> live;
  try {
    authenticate(p, o_, fingerprint_, -1, /*any_rank=*/true,
                 Clock::now() + std::chrono::seconds(10));
    authenticated = true;
    live = std::make_shared<Live>();
    live->fd = p.fd;
    {
      std::lock_guard<std::mutex> lock(mu_);
      live_conns_.push_back(live);
    }
    while (!stopping_.load()) {
      pollfd pfd{p.fd, POLLIN, 0};
      const int r = ::poll(&pfd, 1, 200);
      if (r <= 0) continue;
      const auto deadline = Clock::now() + o_.collective.timeout;
      const FrameHeader h = read_header(p, o_.max_frame_bytes, deadline);
      if (h.kind == static_cast<uint16_t>(FrameKind::kHeartbeat)) continue;
      if (h.kind != static_cast<uint16_t>(FrameKind::kRequest))
        throw DataLoss(detail::str_cat("unexpected frame kind ", h.kind, " from ", p.name,
                                       " (expected a request)"));
      const RpcMessage req = read_message_body(p, h, deadline);
      RpcMessage resp;
      uint8_t status = kOk;
      try {
        resp = handler_(req, p.rank);
        for (const Tensor& t : resp.tensors)
          if (!t.defined() || !t.device().host_accessible())
            throw Internal("the server's handler answered with an undefined or device tensor");
      } catch (const Error& e) {
        status = status_of(e);
        resp = RpcMessage{};
        resp.meta = strip_prefix(e.what());
      } catch (const std::exception& e) {
        status = kInternal;
        resp = RpcMessage{};
        resp.meta = e.what();
      } catch (...) {
        status = kInternal;
        resp = RpcMessage{};
        resp.meta = "unknown exception in the server's handler";
      }
      resp.method = h.op;
      std::lock_guard<std::mutex> send(live->send_mu);
      write_message(p, FrameKind::kResponse, h.seq, static_cast<uint32_t>(o_.rank), status, resp,
                    Clock::now() + o_.collective.timeout);
    }
  } catch (const Unavailable&) {
    if (!stopping_.load()) {
      DTRAIN_LOG(INFO) << name_of(o_, o_.rank) << ": " << p.name << " disconnected";
    }
  } catch (
      const std::exception& e) {  // malformed frames, and e.g. bad_alloc: drop this connection only
    if (!stopping_.load()) {
      DTRAIN_LOG(WARNING) << name_of(o_, o_.rank) << " closed the connection from " << p.name
                          << ": " << e.what();
    }
  } catch (...) {
    DTRAIN_LOG(WARNING) << name_of(o_, o_.rank) << " closed the connection from " << p.name
                        << " after an unknown error";
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& fd : fds_)
      if (fd == p.fd) fd = fds_.back();
    if (!fds_.empty()) fds_.pop_back();
    if (live) {
      live_conns_.erase(std::remove(live_conns_.begin(), live_conns_.end(), live),
                        live_conns_.end());
      std::lock_guard<std::mutex> send(live->send_mu);  // no heartbeat is on its way to this fd
      live->fd = -1;
    }
  }
  ::close(p.fd);
  --live_;
  if (authenticated && on_disconnect_) {
    try {
      on_disconnect_(p.rank);
    } catch (...) {
      DTRAIN_LOG(WARNING) << name_of(o_, o_.rank) << ": the disconnect handler for " << p.name
                          << " failed";
    }
  }
  finished->store(true);
}

// ---------------------------------------------------------------------------------------------
// Client

RpcClient::RpcClient(const TcpGroupOptions& options, int server)
    : o_(tcp::apply_tcp_environment(options)) {
  if (server < 0 || server >= static_cast<int>(o_.addresses.size()) || server == o_.rank)
    throw InvalidArgument(detail::str_cat("RpcClient: bad server index ", server));
  if (o_.token.size() < 16)
    throw InvalidArgument(
        "the job token must be at least 16 characters; set DTRAIN_JOB_TOKEN (dtrain-run generates "
        "one)");
  const std::string& address = o_.addresses[static_cast<size_t>(server)];
  const auto deadline = Clock::now() + o_.connect_timeout;
  for (;;) {
    const int fd = connect_until(address, deadline);
    if (fd >= 0) {
      peer_.fd = fd;
      peer_.address = address;
      peer_.name = name_of(o_, server);
      set_socket_options(fd);
      set_keepalive(fd);
      bool heard = false;
      try {
        authenticate(peer_, o_, job_fingerprint(o_.addresses), server, false, deadline, &heard);
        peer_.stall_timeout = o_.heartbeat_timeout;  // from now on the server sends heartbeats
        return;
      } catch (const Unavailable& e) {
        ::close(fd);
        peer_.fd = -1;
        // Closed before the server's Hello: a listener on its way out (as in the mesh); again.
        if (heard || Clock::now() >= deadline) throw;
        DTRAIN_LOG(INFO) << name_of(o_, o_.rank) << ": the connection to " << peer_.name << " ("
                         << address << ") closed before its handshake (" << e.what()
                         << "); dialing again";
      } catch (...) {
        ::close(fd);
        peer_.fd = -1;
        throw;
      }
    }
    if (Clock::now() >= deadline)
      throw DeadlineExceeded(detail::str_cat(
          name_of(o_, o_.rank), " could not reach ", name_of(o_, server), " (", address,
          ") within ", o_.connect_timeout.count(),
          " ms; start every task of the job (dtrain-run does) or check the addresses"));
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

FrameHeader RpcClient::next_header(Clock::time_point deadline) {
  for (;;) {
    const auto idle = std::min(deadline, Clock::now() + o_.heartbeat_timeout);
    FrameHeader h;
    try {
      h = read_header(peer_, o_.max_frame_bytes, idle);
    } catch (const DeadlineExceeded&) {
      if (Clock::now() < deadline)  // the server sends a heartbeat every heartbeat_interval
        throw Unavailable(detail::str_cat(
            peer_.name, " (", peer_.address, ") sent nothing, not even a heartbeat, for ",
            o_.heartbeat_timeout.count(),
            " ms: it is stopped or hung, or its link is "
            "down. The job cannot continue without it; relaunch the job to resume "
            "from the last checkpoint"));
      throw;
    }
    if (h.kind != static_cast<uint16_t>(FrameKind::kHeartbeat)) return h;
  }
}

RpcClient::~RpcClient() {
  if (peer_.fd >= 0) ::close(peer_.fd);
}

uint64_t RpcClient::send(const RpcMessage& request) {
  if (broken_)
    throw Unavailable("the connection to " + peer_.name +
                      " is unusable after an earlier failure: " + broken_why_);
  size_t bytes = request.meta.size();
  for (const Tensor& t : request.tensors)
    bytes += t.nbytes() + 2 + 8 * static_cast<size_t>(t.rank());
  if (bytes > o_.max_frame_bytes)
    throw InvalidArgument(detail::str_cat("a request of ", bytes, " bytes to ", peer_.name,
                                          " exceeds the frame bound of ", o_.max_frame_bytes,
                                          " bytes; split the variables (a partitioner) or raise "
                                          "max_frame_bytes"));
  const uint64_t id = next_id_++;
  try {
    write_message(peer_, FrameKind::kRequest, id, static_cast<uint32_t>(o_.rank), 0, request,
                  Clock::now() + o_.collective.timeout);
  } catch (const Error& e) {
    broken_ = true;
    broken_why_ = e.what();
    throw;
  }
  return id;
}

RpcMessage RpcClient::receive(uint64_t id, const std::vector<Tensor>* into) {
  if (broken_)
    throw Unavailable("the connection to " + peer_.name +
                      " is unusable after an earlier failure: " + broken_why_);
  if (id < next_to_read_ || id >= next_id_)
    throw InvalidArgument(
        detail::str_cat("receive(", id, ") from ", peer_.name, ": no such outstanding request"));
  uint8_t status = kOk;
  std::string message;
  try {
    const auto deadline = Clock::now() + o_.collective.timeout;
    // Answers to earlier requests nobody waited for (a fan-out that failed elsewhere) are skipped,
    // so the stream stays in step.
    while (next_to_read_ < id) {
      const FrameHeader h = next_header(deadline);
      if (h.kind != static_cast<uint16_t>(FrameKind::kResponse) || h.seq != next_to_read_)
        throw DataLoss(detail::str_cat("out-of-order answer from ", peer_.name,
                                       ": expected response #", next_to_read_, ", got kind ",
                                       h.kind, " #", h.seq));
      read_message_body(peer_, h, deadline);
      ++next_to_read_;
    }
    const FrameHeader h = next_header(deadline);
    if (h.kind != static_cast<uint16_t>(FrameKind::kResponse) || h.seq != id)
      throw DataLoss(detail::str_cat("out-of-order answer from ", peer_.name,
                                     ": expected response #", id, ", got kind ", h.kind, " #",
                                     h.seq));
    RpcMessage m = read_message_body(peer_, h, deadline, h.reduce == kOk ? into : nullptr);
    ++next_to_read_;
    if (h.reduce == kOk) return m;
    status = h.reduce;
    message = peer_.name + " (" + peer_.address + "): " + m.meta;
  } catch (const DeadlineExceeded& e) {
    broken_ = true;  // a late answer would desynchronise the stream
    broken_why_ = e.what();
    throw;
  } catch (const Unavailable& e) {
    broken_ = true;
    broken_why_ = e.what();
    throw;
  } catch (const DataLoss& e) {
    broken_ = true;
    broken_why_ = e.what();
    throw;
  } catch (const std::exception& e) {  // e.g. bad_alloc half-way through a body: the stream is lost
    broken_ = true;
    broken_why_ = e.what();
    throw;
  }
  rethrow(status, message);  // the server answered with an error; the connection stays usable
}

}  // namespace dtrain::tcp
