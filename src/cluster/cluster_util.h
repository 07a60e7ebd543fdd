// Private helpers shared by the cluster resolvers: quoting for messages, address and cluster
// checks that return the problem as text (so each resolver can phrase its own error and example),
// and strict reads of integer environment variables.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

#include "dtrain/cluster/cluster_spec.h"

namespace dtrain::cluster_detail {

// A cluster that satisfies every rule, shown in messages.
inline constexpr const char* kClusterExample =
    R"({"chief": ["host0:2222"], "worker": ["host1:2222", "host2:2222"], "ps": ["host3:2222"]})";

// `s` in double quotes with '"', '\\', control and non-ASCII bytes escaped, cut after `max_chars`
// bytes with "..." and the full length appended.
std::string quote(std::string_view s, size_t max_chars = 120);

// Parses `address` into `out` (may be null). Returns "" when it is a valid host:port, else what is
// wrong with it, quoting it, as a phrase without a final period.
std::string address_problem(std::string_view address, HostPort* out = nullptr);

// Returns "" when `jobs` satisfy ClusterSpec's rules (jobs with no tasks are ignored), else the
// first broken rule, quoting the job or address, as a phrase without a final period.
std::string cluster_problem(const ClusterSpec::JobMap& jobs);

// Host names compare case-insensitively.
std::string lower(std::string_view s);

// The value of environment variable `name`, or nullopt when unset.
std::optional<std::string> get_env(const char* name);

// Parses all of `text` as a decimal integer in [min, max]. Returns nullopt otherwise.
std::optional<long long> parse_int(std::string_view text, long long min, long long max);

// Reads integer variable `name` in [min, max]. Returns nullopt when unset; throws InvalidArgument
// quoting the value when it is set but not such an integer (`hint` says what is expected).
std::optional<int> env_int(const char* name, int min, int max, const std::string& hint);

}  // namespace dtrain::cluster_detail
