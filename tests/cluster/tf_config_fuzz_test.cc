// A deterministic fuzz corpus of malformed TF_CONFIG strings: every truncation of valid configs,
// random byte edits with a fixed seed, and every field given every wrong JSON type. Each string
// must resolve or throw dtrain::InvalidArgument with an example; nothing else, and no crash.
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "dtrain/cluster/cluster_resolver.h"
#include "dtrain/core/error.h"

namespace dtrain {
namespace {

const std::vector<std::string> kValid = {
    R"({"cluster": {"chief": ["host0:2222"], "worker": ["host1:2222", "host2:2222"], )"
    R"("ps": ["[::1]:2223"], "evaluator": ["host5:2222"]}, )"
    R"("task": {"type": "worker", "index": 1}})",
    R"({"cluster":{"worker":["10.0.0.1:5000","10.0.0.2:5000"]},"task":{"type":"worker","index":0},)"
    R"("rpc_layer":"grpc"})",
    "{\n  \"cluster\": {\"worker\": [\"w0.example.com:2222\"]},\n"
    "  \"task\": {\"type\": \"evaluator\", \"index\": 0}\n}",
};

struct Outcome {
  int accepted = 0;
  int rejected = 0;
};

void check(const std::string& text, Outcome& out) {
  try {
    resolve_tf_config(text);
    ++out.accepted;
  } catch (const InvalidArgument& e) {
    ++out.rejected;
    const std::string msg = e.what();
    if (msg.find("A valid TF_CONFIG") == std::string::npos || msg.size() > 2000)
      ADD_FAILURE() << "message without an example or too long for " << text << ": " << msg;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "wrong exception for " << text << ": " << e.what();
  } catch (...) {
    ADD_FAILURE() << "non-std exception for " << text;
  }
}

TEST(TfConfigFuzz, TheValidSeedsResolve) {
  for (const auto& v : kValid) EXPECT_NO_THROW(resolve_tf_config(v)) << v;
}

TEST(TfConfigFuzz, EveryTruncationIsRejected) {
  Outcome out;
  int n = 0;
  for (const auto& v : kValid)
    for (size_t len = 0; len < v.size(); ++len, ++n) check(v.substr(0, len), out);
  EXPECT_GE(n, 300);
  EXPECT_EQ(out.accepted, 0);  // a prefix of one JSON object is never a complete one
  EXPECT_EQ(out.rejected, n);
}

TEST(TfConfigFuzz, RandomByteEdits) {
  std::mt19937 rng(20240501);
  const std::string specials =
      std::string("{}[]\":,-.0123456789 \\eE+tfn") + '\0' + '\xff' + '\x80';
  Outcome out;
  const int kCases = 1500;
  for (int i = 0; i < kCases; ++i) {
    std::string s = kValid[static_cast<size_t>(i) % kValid.size()];
    const int edits = 1 + static_cast<int>(rng() % 3);
    for (int e = 0; e < edits; ++e) {
      const size_t pos = rng() % s.size();
      switch (rng() % 4) {
        case 0:
          s[pos] = static_cast<char>(s[pos] ^ (1u << (rng() % 8)));
          break;  // bit flip
        case 1:
          s[pos] = specials[rng() % specials.size()];
          break;
        case 2:
          s.erase(pos, 1 + rng() % 4);
          break;
        default:
          s.insert(pos, 1, specials[rng() % specials.size()]);
          break;
      }
      if (s.empty()) s = "{";
    }
    check(s, out);
  }
  EXPECT_EQ(out.accepted + out.rejected, kCases);
  EXPECT_GT(out.rejected, kCases / 2);
}

TEST(TfConfigFuzz, EveryFieldWithEveryWrongType) {
  const std::vector<std::string> values = {"null",
                                           "true",
                                           "false",
                                           "0",
                                           "-1",
                                           "1.5",
                                           "1e400",
                                           "18446744073709551616",
                                           R"("")",
                                           R"("worker")",
                                           R"("a:1")",
                                           "[]",
                                           "{}",
                                           "[1]",
                                           R"(["a:1"])",
                                           R"([["a:1"]])",
                                           R"({"a": 1})",
                                           R"({"worker": ["a:1"]})",
                                           std::string(5000, '[') + std::string(5000, ']')};
  // Each template has one hole, "@", where a value goes.
  const std::vector<std::string> templates = {
      "@",
      R"({"cluster": @, "task": {"type": "worker", "index": 0}})",
      R"({"cluster": {"worker": @}, "task": {"type": "worker", "index": 0}})",
      R"({"cluster": {"worker": ["a:1", @]}, "task": {"type": "worker", "index": 0}})",
      R"({"cluster": {"chief": @, "worker": ["a:1"]}, "task": {"type": "worker", "index": 0}})",
      R"({"cluster": {"worker": ["a:1"]}, "task": @})",
      R"({"cluster": {"worker": ["a:1"]}, "task": {"type": @, "index": 0}})",
      R"({"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": @}})",
      R"({"cluster": {"worker": ["a:1"]}, "task": {"type": "evaluator", "index": @}})",
      R"({"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 0}, "x": @})",
      R"({@: {"worker": ["a:1"]}, "task": {"type": "worker", "index": 0}})",
  };
  Outcome out;
  int n = 0;
  for (const auto& t : templates)
    for (const auto& v : values) {
      std::string s = t;
      s.replace(s.find('@'), 1, v);
      check(s, out);
      ++n;
    }
  EXPECT_EQ(out.accepted + out.rejected, n);
  EXPECT_GE(out.rejected, 150);
}

}  // namespace
}  // namespace dtrain
