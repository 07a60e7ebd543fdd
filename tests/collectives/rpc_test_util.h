// Helpers shared by the RPC tests (rpc_test.cc, rpc_wire_test.cc): options for a group of a ps and
// workers on 127.0.0.1, bounded waits, and typed-exception checks that fail on a wrong type.
#pragma once

#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <ostream>
#include <random>
#include <thread>
#include <typeinfo>

#include "collectives/tcp/auth.h"
#include "collectives/tcp/rpc.h"
#include "testing/ports.h"

namespace dtrain::tcp {
namespace {

using namespace std::chrono_literals;
using Map = std::map<int, int>;
const std::string kToken = "rpc-test-job-token-0123456789";

// addresses = {ps:0, worker:0, worker:1, ...}; rank = index.
inline TcpGroupOptions options(const std::vector<std::string>& addrs, int rank,
                               const std::string& token = kToken) {
  TcpGroupOptions o;
  o.rank = rank;
  o.addresses = addrs;
  o.task_names = {"ps:0"};
  for (size_t i = 1; i < addrs.size(); ++i)
    o.task_names.push_back("worker:" + std::to_string(i - 1));
  o.token = token;
  o.connect_timeout = 5s;
  o.collective.timeout = 10s;
  return o;
}

inline RpcMessage echo(const RpcMessage& m, int) { return m; }

struct Disconnects {  // disconnect callbacks by client rank
  std::mutex mu;
  Map by_rank;
  RpcDisconnect callback() {
    return [this](int r) {
      std::lock_guard<std::mutex> l(mu);
      ++by_rank[r];
    };
  }
  Map get() {
    std::lock_guard<std::mutex> l(mu);
    return by_rank;
  }
};

inline bool wait_until(const std::function<bool()>& pred, std::chrono::milliseconds limit = 5s) {
  for (const auto end = std::chrono::steady_clock::now() + limit; !pred();
       std::this_thread::sleep_for(5ms))
    if (std::chrono::steady_clock::now() > end) return false;
  return true;
}

// What f threw. `typed`: it threw an E and `what` is its what(); otherwise `what` says what it
// threw instead (or that it threw nothing), and no comparison with a message succeeds, so a wrong
// type with the right text fails.
struct Thrown {
  bool threw = false;
  bool typed = false;
  std::string what;
  friend bool operator==(const Thrown& t, const std::string& message) {
    return t.typed && t.what == message;
  }
  friend std::ostream& operator<<(std::ostream& os, const Thrown& t) {
    return os << (t.typed ? "" : t.threw ? "[WRONG EXCEPTION TYPE] " : "[NO EXCEPTION] ") << t.what;
  }
};

template <typename E>
inline Thrown what_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const E& e) {
    return {true, true, e.what()};
  } catch (const std::exception& e) {
    return {true, false, std::string(typeid(e).name()) + ": " + e.what()};
  }
  return {false, false, ""};
}

// An E was thrown and its message contains `part`.
inline ::testing::AssertionResult has(const Thrown& t, const std::string& part) {
  if (!t.typed) return ::testing::AssertionFailure() << "not the expected exception type: " << t;
  if (t.what.find(part) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "'" << t.what << "' does not contain '" << part << "'";
}

inline Tensor random_tensor(const Shape& s, DType t, uint64_t seed) {
  Tensor x = Tensor::empty(s, t);
  std::mt19937_64 rng(seed);
  auto* b = static_cast<unsigned char*>(x.raw_data());
  for (size_t i = 0; i < x.nbytes(); ++i) b[i] = static_cast<unsigned char>(rng());
  return x;
}

inline std::string u64_meta(uint64_t v) { return MetaWriter().u64(v).take(); }
inline uint64_t meta_u64(const RpcMessage& m) {
  MetaReader r(m.meta, "test meta");
  const uint64_t v = r.u64();
  r.expect_end();
  return v;
}

inline sockaddr_in loopback(int port) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<uint16_t>(port));
  return a;
}

}  // namespace
}  // namespace dtrain::tcp
