// TF_CONFIG: the only place nlohmann/json is used by the cluster layer. Its exceptions are caught
// here and rethrown as dtrain::InvalidArgument.
#include <cstdint>
#include <limits>
#include <nlohmann/json.hpp>

#include "cluster/cluster_util.h"
#include "dtrain/cluster/cluster_resolver.h"
#include "dtrain/core/error.h"

namespace dtrain {
namespace {

using json = nlohmann::json;
using cluster_detail::quote;

constexpr const char* kExample =
    R"(TF_CONFIG='{"cluster": {"chief": ["host0:2222"], "worker": ["host1:2222", "host2:2222"]}, )"
    R"("task": {"type": "worker", "index": 0}}')";
constexpr size_t kMaxBytes = size_t{16} << 20;
constexpr const char* kTaskTypes = R"("chief", "worker", "ps" or "evaluator")";

[[noreturn]] void fail(const std::string& problem) {
  throw InvalidArgument("TF_CONFIG " + problem + ". A valid TF_CONFIG: " + kExample);
}

// nlohmann's messages may echo raw input bytes; keep messages printable.
std::string printable(std::string s) {
  for (char& c : s)
    if (static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) >= 0x7f) c = '?';
  return s;
}

// A short rendering of a JSON value for messages. Bounded in depth and length, unlike dump(),
// so a hostile value (deeply nested, huge) cannot blow the stack or the message.
void brief_into(const json& v, int depth, std::string& out, size_t limit) {
  if (out.size() > limit) return;
  if (v.is_string()) {
    out += quote(v.get_ref<const std::string&>(), 60);
  } else if (v.is_array() || v.is_object()) {
    const bool arr = v.is_array();
    out += arr ? "[" : "{";
    if (depth >= 3 && !v.empty()) {
      out += "...";
    } else {
      bool first = true;
      for (auto it = v.begin(); it != v.end(); ++it) {
        if (out.size() > limit) {
          out += ", ...";
          break;
        }
        if (!first) out += ", ";
        first = false;
        if (!arr) out += quote(it.key(), 40) + ": ";
        brief_into(it.value(), depth + 1, out, limit);
      }
    }
    out += arr ? "]" : "}";
  } else if (v.is_discarded()) {
    out += "<discarded>";
  } else {
    out += v.dump();  // a number, boolean or null: no recursion
  }
}

std::string brief(const json& v) {
  std::string s;
  brief_into(v, 0, s, 100);
  if (s.size() > 160) s = s.substr(0, 160) + "...";
  return s;
}

std::string described(const json& v) { return std::string(v.type_name()) + " " + brief(v); }

std::string keys_of(const json& object) {
  std::string s = "[";
  for (auto it = object.begin(); it != object.end() && s.size() < 120; ++it)
    s += (s.size() > 1 ? ", " : "") + quote(it.key(), 30);
  return s + "]";
}

json parse_json(const std::string& text) {
  try {
    return json::parse(text);
  } catch (const json::parse_error& e) {
    const size_t at = e.byte == 0 ? 0 : std::min<size_t>(e.byte - 1, text.size());
    const size_t from = at > 30 ? at - 30 : 0;
    const std::string before = text.substr(from, at - from);
    const std::string after = at < text.size() ? text.substr(at, 10) : "";
    fail("is not valid JSON: error at byte " + std::to_string(e.byte) + ", " +
         (before.empty() ? "at the start" : "after " + quote(before)) +
         (after.empty() ? " (the text ends there)" : " at " + quote(after)) + " (" +
         printable(e.what()) + ")");
  }
}

ClusterSpec::JobMap read_cluster(const json& config) {
  auto found = config.find("cluster");
  if (found == config.end())
    fail("has no \"cluster\" (its keys are " + keys_of(config) +
         "); \"cluster\" lists every task's host:port by job. To train on one machine, unset "
         "TF_CONFIG");
  const json& cluster = *found;
  if (!cluster.is_object())
    fail("\"cluster\" must be an object mapping job names to address lists, but it is " +
         described(cluster));
  ClusterSpec::JobMap jobs;
  for (auto it = cluster.begin(); it != cluster.end(); ++it) {
    const std::string& name = it.key();
    const auto type = task_type_from_name(name);
    if (!type)
      fail("\"cluster\" has unknown job " + quote(name) + "; jobs are " + kTaskTypes +
           (task_type_from_name(cluster_detail::lower(name)) ? " (job names are lower-case)" : ""));
    const json& tasks = it.value();
    if (!tasks.is_array())
      fail("\"cluster\" job " + quote(name) +
           " must be a list of \"host:port\" strings, but it is " + described(tasks) + "; write " +
           quote(name) + ": [\"host1:2222\", \"host2:2222\"]");
    auto& out = jobs[*type];
    for (size_t i = 0; i < tasks.size(); ++i) {
      if (!tasks[i].is_string())
        fail("\"cluster\" job " + quote(name) + " task " + std::to_string(i) + " is " +
             described(tasks[i]) + ", not a \"host:port\" string such as \"host1:2222\"");
      out.push_back(tasks[i].get<std::string>());
    }
  }
  const std::string problem = cluster_detail::cluster_problem(jobs);
  if (!problem.empty()) fail("\"cluster\": " + problem);
  return jobs;
}

ClusterResolution resolve(const std::string& text) {
  bool blank = true;
  for (char c : text)
    if (c != ' ' && c != '\t' && c != '\n' && c != '\r') blank = false;
  if (blank) fail("is empty; set it to a JSON object, or unset it to train on one machine");
  if (text.size() > kMaxBytes)
    fail("is " + std::to_string(text.size()) + " bytes starting " + quote(text, 40) +
         "; a cluster description is far smaller");
  const json config = parse_json(text);
  if (!config.is_object()) fail("must be a JSON object, but it is " + described(config));
  ClusterSpec::JobMap jobs = read_cluster(config);
  const ClusterSpec spec(std::move(jobs));

  auto found = config.find("task");
  if (found == config.end())
    fail("has no \"task\" (its keys are " + keys_of(config) +
         "); \"task\" says which task this process is, e.g. \"task\": {\"type\": \"worker\", "
         "\"index\": 0}");
  const json& task = *found;
  if (!task.is_object())
    fail("\"task\" must be an object such as {\"type\": \"worker\", \"index\": 0}, but it is " +
         described(task));

  auto type_it = task.find("type");
  if (type_it == task.end())
    fail("\"task\" " + brief(task) + " has no \"type\"; set it to " + kTaskTypes);
  if (!type_it->is_string())
    fail("\"task\".\"type\" must be a string, one of " + std::string(kTaskTypes) + ", but it is " +
         described(*type_it));
  const std::string& type_name = type_it->get_ref<const std::string&>();
  const auto type = task_type_from_name(type_name);
  if (!type)
    fail("\"task\".\"type\" " + quote(type_name) + " is not a task type; use " + kTaskTypes +
         (task_type_from_name(cluster_detail::lower(type_name)) ? " (lower-case)" : ""));

  auto index_it = task.find("index");
  if (index_it == task.end())
    fail("\"task\" " + brief(task) + " has no \"index\"; set it to this task's position in its " +
         "job's list, starting at 0");
  const json& index = *index_it;
  if (index.is_string())
    fail("\"task\".\"index\" is the string " + brief(index) +
         "; write it as a number without quotes: \"index\": 0");
  if (!index.is_number_integer())
    fail("\"task\".\"index\" must be a non-negative integer, but it is " + described(index));
  if (!index.is_number_unsigned() && index.get<int64_t>() < 0)
    fail("\"task\".\"index\" " + brief(index) + " is negative; indices start at 0");
  const uint64_t value = index.is_number_unsigned() ? index.get<uint64_t>()
                                                    : static_cast<uint64_t>(index.get<int64_t>());
  const int n = spec.num_tasks(*type);
  if (n == 0 && *type != TaskType::kEvaluator)
    fail("\"task\".\"type\" " + quote(type_name) + " is not a job of \"cluster\", whose jobs are " +
         spec.to_json() + "; add a " + quote(type_name) + " job or fix the type");
  if (n > 0 && value >= static_cast<uint64_t>(n))
    fail("\"task\".\"index\" " + brief(index) + " is out of range: job " + quote(type_name) +
         " has " + std::to_string(n) + (n == 1 ? " task" : " tasks") +
         ", so the index must be in 0.." + std::to_string(n - 1));
  if (value > static_cast<uint64_t>(std::numeric_limits<int>::max()))
    fail("\"task\".\"index\" " + brief(index) + " is too large");
  if (n == 0 && value != 0)  // at most one evaluator, in the cluster or not
    fail(
        "\"task\".\"index\" " + brief(index) +
        " is out of range: an evaluator outside \"cluster\" is task evaluator:0; set \"index\": 0");
  return ClusterResolution(spec, *type, static_cast<int>(value), "TF_CONFIG");
}

}  // namespace

ClusterResolution resolve_tf_config(const std::string& text) {
  try {
    return resolve(text);
  } catch (const json::exception& e) {
    fail("could not be read: " + printable(e.what()));
  }
}

std::optional<ClusterResolution> from_environment() {
  const auto text = cluster_detail::get_env("TF_CONFIG");
  if (!text) return std::nullopt;
  bool blank = true;
  for (char c : *text)
    if (c != ' ' && c != '\t' && c != '\n' && c != '\r') blank = false;
  if (blank) return std::nullopt;
  return resolve_tf_config(*text);
}

std::string make_tf_config(const ClusterSpec& cluster, TaskType type, int index) {
  const ClusterResolution check(cluster, type, index, "make_tf_config");  // throws if impossible
  try {
    nlohmann::ordered_json jobs = nlohmann::ordered_json::object();
    for (TaskType t : cluster.jobs()) jobs[task_type_name(t)] = cluster.job_tasks(t);
    nlohmann::ordered_json config;
    config["cluster"] = std::move(jobs);
    config["task"] = {{"type", task_type_name(type)}, {"index", index}};
    return config.dump();
  } catch (const nlohmann::ordered_json::exception& e) {
    throw Internal("make_tf_config: " + printable(e.what()) + " (this is a dtrain bug)");
  }
}

}  // namespace dtrain
