// Request/response messaging over the TCP transport, for the parameter servers. It shares the
// collectives' wire format (frame.h), socket I/O (io.h) and job-token authentication (auth.h):
// one transport, one auth scheme.
//
// A message is a method number, a small "meta" byte string of method-specific fields (written
// with MetaWriter, read with MetaReader, which throws DataLoss on anything short or malformed),
// and a list of CPU tensors sent raw, straight from and into tensor memory:
//
//   header(kind=Request|Response, seq=id, op=method, reduce=status, count=#tensors)
//   u32 meta_len, meta, per tensor {u8 dtype, u8 rank, i64 dims[rank]}, tensor bytes...
//
// Every length is checked against the frame's payload_bytes and the server's bound before any
// allocation. A handler's dtrain::Error travels back to the caller and is rethrown there with the
// same type; a malformed frame closes that one connection (logged), never the server.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "collectives/tcp/io.h"
#include "dtrain/collectives/tcp.h"
#include "dtrain/core/tensor.h"

namespace dtrain::tcp {

struct RpcMessage {
  uint16_t method = 0;
  std::string meta;
  std::vector<Tensor> tensors;  // CPU tensors
};

class MetaWriter {
 public:
  MetaWriter& u64(uint64_t v) { return raw(&v, 8); }
  MetaWriter& i64(int64_t v) { return raw(&v, 8); }
  MetaWriter& u8(uint8_t v) { return raw(&v, 1); }
  MetaWriter& str(const std::string& s);
  std::string take() { return std::move(out_); }

 private:
  MetaWriter& raw(const void* p, size_t n);
  std::string out_;
};

class MetaReader {
 public:
  // `what` names the message in errors ("push request from worker:1").
  MetaReader(const std::string& meta, std::string what) : s_(meta), what_(std::move(what)) {}
  MetaReader(std::string&&, std::string) = delete;  // it keeps a reference: no temporaries
  uint64_t u64();
  int64_t i64();
  uint8_t u8();
  std::string str(size_t max_len = 4096);
  // Throws DataLoss when bytes are left over.
  void expect_end() const;

 private:
  void need(size_t n) const;
  const std::string& s_;
  std::string what_;
  size_t pos_ = 0;
};

// Handles one request from the authenticated task `client_rank` (an index into the group's
// addresses). May run concurrently for different connections. Throw a dtrain::Error to answer
// with an error.
using RpcHandler = std::function<RpcMessage(const RpcMessage& request, int client_rank)>;
// Called once when a client's connection ends for any reason (closed, killed, malformed frame).
using RpcDisconnect = std::function<void(int client_rank)>;

// Listens on options.addresses[options.rank] and serves every task of the job that proves the
// token; one thread per connection. A heartbeat thread sends every connection a heartbeat frame
// each heartbeat_interval between answers, so a client waiting on a slow answer can tell a busy
// server from a stopped, hung or unreachable one. Thread-safety: stop() may be called from any
// thread.
class RpcServer {
 public:
  // Throws Unavailable when the address cannot be bound, InvalidArgument for a bad address/token.
  RpcServer(TcpGroupOptions options, RpcHandler handler, RpcDisconnect on_disconnect = {});
  ~RpcServer();
  RpcServer(const RpcServer&) = delete;
  RpcServer& operator=(const RpcServer&) = delete;
  // Stops accepting, closes every connection and joins the threads. Idempotent.
  void stop();
  int connections() const { return live_.load(); }

 private:
  void accept_loop();
  void serve(Peer peer, std::shared_ptr<std::atomic<bool>> finished);
  void heartbeat_loop();
  // An authenticated connection: its socket (-1 once closed) and the lock that keeps an answer and
  // a heartbeat from interleaving on it.
  struct Live {
    int fd = -1;
    std::mutex send_mu;
  };
  TcpGroupOptions o_;
  uint64_t fingerprint_;
  RpcHandler handler_;
  RpcDisconnect on_disconnect_;
  int listen_fd_ = -1;
  std::atomic<bool> stopping_{false};
  std::atomic<int> live_{0};
  std::mutex mu_;
  std::vector<int> fds_;  // open connections, for stop()
  struct Connection {
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> finished;
  };
  std::vector<Connection> threads_;  // guarded by mu_; finished ones are joined at the next accept
  std::vector<std::shared_ptr<Live>> live_conns_;  // guarded by mu_
  std::thread acceptor_;
  std::thread heartbeat_;
  std::condition_variable hb_cv_;  // with mu_: wakes the heartbeat thread to stop
};

// One authenticated connection to the server `server` (an index into options.addresses).
// Requests are answered in order, so several may be sent before the first receive (pipelining to
// several servers at once is the caller's business). Not thread-safe: one caller at a time.
class RpcClient {
 public:
  // Dials until options.connect_timeout. Throws DeadlineExceeded naming the server when it never
  // answers, PermissionDenied when the token is refused.
  RpcClient(const TcpGroupOptions& options, int server);
  ~RpcClient();
  RpcClient(const RpcClient&) = delete;
  RpcClient& operator=(const RpcClient&) = delete;
  // Sends a request and returns its id.
  uint64_t send(const RpcMessage& request);
  // Waits (options.collective.timeout) for the response to `id`. Rethrows the server's error with
  // its type; Unavailable when the server's connection closed, or when nothing, not even a
  // heartbeat, came from it for options.heartbeat_timeout (stopped, hung, or its link is down);
  // DeadlineExceeded when it kept sending heartbeats but no answer within the timeout. into:
  // tensors the response's tensors are read straight into when shape and dtype match (the returned
  // message then holds those same tensors), saving a copy of large pulls.
  RpcMessage receive(uint64_t id, const std::vector<Tensor>* into = nullptr);
  RpcMessage call(const RpcMessage& request) { return receive(send(request)); }
  const std::string& server_name() const { return peer_.name; }
  const std::string& server_address() const { return peer_.address; }

 private:
  // The next frame header that is not a heartbeat, enforcing the heartbeat timeout.
  FrameHeader next_header(Clock::time_point deadline);
  TcpGroupOptions o_;
  Peer peer_;
  uint64_t next_id_ = 1;
  uint64_t next_to_read_ = 1;  // responses arrive in request order
  bool broken_ = false;
  std::string broken_why_;
};

// Wire helpers, exposed for the fuzz tests.
void write_message(const Peer& peer, FrameKind kind, uint64_t id, uint32_t sender, uint8_t status,
                   const RpcMessage& m, Clock::time_point deadline);
RpcMessage read_message_body(const Peer& peer, const FrameHeader& h, Clock::time_point deadline,
                             const std::vector<Tensor>* into = nullptr);

}  // namespace dtrain::tcp
