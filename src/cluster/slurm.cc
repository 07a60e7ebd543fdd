// SLURM: the task srun started, from the step's variables. SLURM says which nodes the step runs
// on and how many tasks each node has, but not which task is where; that follows from the
// distribution (block by default), which we replay, and check against SLURM_LOCALID.
#include <algorithm>

#include "cluster/cluster_util.h"
#include "dtrain/cluster/cluster_resolver.h"
#include "dtrain/core/error.h"
#include "dtrain/core/strings.h"

namespace dtrain {
namespace {

using cluster_detail::quote;

constexpr size_t kMaxHosts = size_t{1} << 20;
constexpr const char* kNodelistExample = R"(such as "node[01-04,07]" or "a[1-2],b3")";

bool is_digit(char c) { return c >= '0' && c <= '9'; }
bool is_name_char(char c) {
  return is_digit(c) || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '-' || c == '.' ||
         c == '_';
}

[[noreturn]] void bad_list(const std::string& label, const std::string& list,
                           const std::string& problem) {
  throw InvalidArgument(label + quote(list) + " is not a valid SLURM node list: " + problem +
                        "; expected a list " + kNodelistExample);
}

// The values of one bracket group "01-04,07" -> 01 02 03 04 07.
std::vector<std::string> expand_group(std::string_view group, const std::string& label,
                                      const std::string& list) {
  std::vector<std::string> out;
  for (const std::string_view range : split_list(group)) {
    const size_t dash = range.find('-');
    const std::string_view lo = range.substr(0, dash);
    const std::string_view hi = dash == std::string_view::npos ? lo : range.substr(dash + 1);
    if (lo.empty() || hi.empty() || lo.size() > 18 || hi.size() > 18 ||
        !std::all_of(lo.begin(), lo.end(), is_digit) ||
        !std::all_of(hi.begin(), hi.end(), is_digit))
      bad_list(label, list,
               "range " + quote(range) + " in [" + std::string(group) +
                   "] is not a number or two numbers joined by '-'");
    const long long a = *cluster_detail::parse_int(lo, 0, 999999999999999999LL);
    const long long b = *cluster_detail::parse_int(hi, 0, 999999999999999999LL);
    if (a > b) bad_list(label, list, "range " + quote(range) + " goes down; write it low-high");
    if (static_cast<unsigned long long>(b - a) + out.size() >= kMaxHosts)
      bad_list(label, list, "it names more than " + std::to_string(kMaxHosts) + " hosts");
    for (long long v = a; v <= b; ++v) {
      std::string digits = std::to_string(v);
      if (digits.size() < lo.size()) digits.insert(0, lo.size() - digits.size(), '0');
      out.push_back(std::move(digits));
    }
  }
  return out;
}

// One host expression "rack[1-2]-n[01-02]": literals and bracket groups, expanded as a cartesian
// product with earlier groups varying slowest (SLURM's order).
void expand_item(std::string_view item, const std::string& label, const std::string& list,
                 std::vector<std::string>& out) {
  if (item.empty()) bad_list(label, list, "it has an empty host name (two commas in a row?)");
  std::vector<std::string> names{""};
  size_t i = 0;
  while (i < item.size()) {
    if (item[i] == '[') {
      const size_t close = item.find(']', i);
      const std::vector<std::string> values =
          expand_group(item.substr(i + 1, close - i - 1), label, list);
      if (names.size() * values.size() + out.size() > kMaxHosts)
        bad_list(label, list, "it names more than " + std::to_string(kMaxHosts) + " hosts");
      std::vector<std::string> next;
      next.reserve(names.size() * values.size());
      for (const auto& n : names)
        for (const auto& v : values) next.push_back(n + v);
      names = std::move(next);
      i = close + 1;
    } else {
      if (!is_name_char(item[i]))
        bad_list(label, list,
                 "host " + quote(item) + " has the character " + quote(item.substr(i, 1)) +
                     "; host names have letters, digits, '-', '.' and '_'");
      for (auto& n : names) n += item[i];
      ++i;
    }
  }
  for (auto& n : names) out.push_back(std::move(n));
}

std::vector<std::string> expand_nodelist(const std::string& list, const std::string& label) {
  if (list.empty()) bad_list(label, list, "it is empty");
  // Split at the commas outside brackets, checking the brackets balance and do not nest.
  std::vector<std::string> out;
  bool open = false;
  size_t item_start = 0;
  for (size_t i = 0; i < list.size(); ++i) {
    if (list[i] == '[') {
      if (open) bad_list(label, list, "brackets nest at byte " + std::to_string(i));
      open = true;
    } else if (list[i] == ']') {
      if (!open) bad_list(label, list, "the ']' at byte " + std::to_string(i) + " has no '['");
      open = false;
    } else if (list[i] == ',' && !open) {
      expand_item(std::string_view(list).substr(item_start, i - item_start), label, list, out);
      item_start = i + 1;
    }
  }
  if (open) bad_list(label, list, "a '[' is never closed");
  expand_item(std::string_view(list).substr(item_start), label, list, out);
  return out;
}

std::vector<int> parse_tpn(const std::string& text, const std::string& label) {
  auto bad = [&](const std::string& problem) {
    throw InvalidArgument(label + quote(text) +
                          " is not a valid SLURM tasks-per-node list: " + problem +
                          "; expected counts such as \"2(x3),1\" (three nodes with 2 "
                          "tasks, then one with 1)");
  };
  if (text.empty()) bad("it is empty");
  std::vector<int> out;
  for (const std::string_view item : split_list(text)) {
    const size_t paren = item.find('(');
    const auto count = cluster_detail::parse_int(item.substr(0, paren), 1, 1 << 20);
    if (!count || item.substr(0, paren).front() == '+')
      bad("count " + quote(item.substr(0, paren)) + " is not a number from 1 up");
    long long repeat = 1;
    if (paren != std::string_view::npos) {
      const std::string_view rep = item.substr(paren);
      const auto r = rep.size() > 3 && rep.substr(0, 2) == "(x" && rep.back() == ')'
                         ? cluster_detail::parse_int(rep.substr(2, rep.size() - 3), 1, 1 << 20)
                         : std::nullopt;
      if (!r || rep[2] == '+') bad("repeat " + quote(rep) + " is not \"(xN)\" with N from 1 up");
      repeat = *r;
    }
    if (out.size() + static_cast<size_t>(repeat) > kMaxHosts)
      bad("it lists more than " + std::to_string(kMaxHosts) + " nodes");
    out.insert(out.end(), static_cast<size_t>(repeat), static_cast<int>(*count));
  }
  return out;
}

// The first variable of `names` that is set, and its name.
std::optional<std::pair<std::string, std::string>> first_env(
    std::initializer_list<const char*> names) {
  for (const char* n : names)
    if (auto v = cluster_detail::get_env(n)) return std::make_pair(std::string(n), *v);
  return std::nullopt;
}

}  // namespace

std::vector<std::string> expand_slurm_nodelist(const std::string& nodelist) {
  return expand_nodelist(nodelist, "node list ");
}

std::vector<int> parse_slurm_tasks_per_node(const std::string& tasks_per_node) {
  return parse_tpn(tasks_per_node, "tasks per node ");
}

ClusterResolution resolve_slurm(int port_base) {
  const std::string under_srun =
      "start each task with srun (e.g. srun --ntasks=4 ./train), or "
      "set TF_CONFIG instead";
  const auto procid = cluster_detail::env_int("SLURM_PROCID", 0, 1 << 24, under_srun);
  if (!procid) throw FailedPrecondition("SLURM: SLURM_PROCID is unset; " + under_srun);
  std::optional<int> ntasks;
  std::string ntasks_name = "SLURM_STEP_NUM_TASKS";
  ntasks = cluster_detail::env_int("SLURM_STEP_NUM_TASKS", 1, 1 << 24, under_srun);
  if (!ntasks) {
    ntasks_name = "SLURM_NTASKS";
    ntasks = cluster_detail::env_int("SLURM_NTASKS", 1, 1 << 24, under_srun);
  }
  if (!ntasks)
    throw FailedPrecondition("SLURM: neither SLURM_STEP_NUM_TASKS nor SLURM_NTASKS is set; " +
                             under_srun);
  const auto nodelist = first_env({"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"});
  if (!nodelist)
    throw FailedPrecondition(
        "SLURM: none of SLURM_STEP_NODELIST, SLURM_JOB_NODELIST and "
        "SLURM_NODELIST is set; " +
        under_srun);
  const std::vector<std::string> nodes = expand_nodelist(nodelist->second, nodelist->first + "=");
  const std::string nodes_text = nodelist->first + "=" + quote(nodelist->second);

  std::vector<int> counts;
  if (auto tpn = first_env({"SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"})) {
    counts = parse_tpn(tpn->second, tpn->first + "=");
    const std::string tpn_text = tpn->first + "=" + quote(tpn->second);
    if (counts.size() != nodes.size())
      throw InvalidArgument("SLURM: " + tpn_text + " gives " + std::to_string(counts.size()) +
                            " node(s) but " + nodes_text + " has " + std::to_string(nodes.size()) +
                            "; they must describe the same step");
    long long sum = 0;
    for (int c : counts) sum += c;
    if (sum != *ntasks)
      throw InvalidArgument("SLURM: " + tpn_text + " adds up to " + std::to_string(sum) +
                            " tasks but " + ntasks_name + "=" + std::to_string(*ntasks) +
                            "; they must describe the same step");
  } else {
    if (*ntasks % static_cast<int>(nodes.size()) != 0)
      throw InvalidArgument(
          "SLURM: " + ntasks_name + "=" + std::to_string(*ntasks) +
          " tasks do not split evenly over the " + std::to_string(nodes.size()) + " nodes of " +
          nodes_text + " and SLURM_STEP_TASKS_PER_NODE is unset; run under srun, which sets it");
    counts.assign(nodes.size(), *ntasks / static_cast<int>(nodes.size()));
  }
  if (*procid >= *ntasks)
    throw InvalidArgument("SLURM: SLURM_PROCID=" + std::to_string(*procid) + " is not below " +
                          ntasks_name + "=" + std::to_string(*ntasks));

  std::string dist = cluster_detail::get_env("SLURM_DISTRIBUTION").value_or("block");
  const std::string dist_full = dist;
  dist = dist.substr(0, dist.find_first_of(":,"));
  const bool cyclic = dist == "cyclic";
  if (!cyclic && dist != "block" && dist != "*" && !dist.empty())
    throw Unimplemented("SLURM: SLURM_DISTRIBUTION=" + quote(dist_full) +
                        " places tasks in a way dtrain cannot reconstruct; use srun "
                        "--distribution=block or cyclic, or set TF_CONFIG");

  const int max_per_node = *std::max_element(counts.begin(), counts.end());
  if (port_base < 1 || static_cast<long long>(port_base) + max_per_node - 1 > 65535)
    throw InvalidArgument("SLURM: port base " + std::to_string(port_base) + " with up to " +
                          std::to_string(max_per_node) +
                          " tasks per node leaves the ports "
                          "1-65535; pick a base such as 23456");

  // Replay the distribution: task -> (node, index on that node).
  const size_t num_tasks = static_cast<size_t>(*ntasks);
  std::vector<int> node_of(num_tasks), local_of(num_tasks), placed(nodes.size(), 0);
  if (cyclic) {
    size_t t = 0;
    while (t < num_tasks)
      for (size_t n = 0; n < nodes.size() && t < num_tasks; ++n)
        if (placed[n] < counts[n]) {
          node_of[t] = static_cast<int>(n);
          local_of[t++] = placed[n]++;
        }
  } else {
    size_t t = 0;
    for (size_t n = 0; n < nodes.size(); ++n)
      for (int l = 0; l < counts[n]; ++l, ++t) {
        node_of[t] = static_cast<int>(n);
        local_of[t] = l;
      }
  }
  std::vector<std::string> workers(num_tasks);
  for (size_t t = 0; t < num_tasks; ++t)
    workers[t] =
        nodes[static_cast<size_t>(node_of[t])] + ":" + std::to_string(port_base + local_of[t]);

  const size_t me = static_cast<size_t>(*procid);
  const int local_rank = local_of[me];
  const int local_size = counts[static_cast<size_t>(node_of[me])];
  if (auto localid = cluster_detail::env_int("SLURM_LOCALID", 0, 1 << 24, under_srun);
      localid && *localid != local_rank)
    throw FailedPrecondition("SLURM: SLURM_LOCALID=" + std::to_string(*localid) + " but task " +
                             std::to_string(*procid) + " should be local task " +
                             std::to_string(local_rank) + " on " +
                             nodes[static_cast<size_t>(node_of[me])] + " under the " +
                             (cyclic ? "cyclic" : "block") + " distribution of " + nodes_text +
                             "; set SLURM_DISTRIBUTION to match srun's "
                             "--distribution, or set TF_CONFIG");

  ClusterResolution r(ClusterSpec({{TaskType::kWorker, std::move(workers)}}), TaskType::kWorker,
                      *procid, "SLURM");
  r.set_local_placement(local_rank, local_size);
  return r;
}

}  // namespace dtrain
