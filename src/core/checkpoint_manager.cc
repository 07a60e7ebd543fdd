// CheckpointManager: numbered checkpoint files in one directory, an index naming the newest, and
// restore that falls back past damaged files (include/dtrain/core/checkpoint.h).
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <nlohmann/json.hpp>

#include "core/checkpoint_files.h"
#include "dtrain/core/checkpoint.h"
#include "dtrain/core/logging.h"

namespace dtrain {
namespace {

namespace fs = std::filesystem;
using ojson = nlohmann::ordered_json;
using detail::Fd;
using detail::kIndexName;
using detail::kMaxIndexBytes;
using detail::Piece;
using detail::printable;
using detail::write_atomically;

}  // namespace

namespace {

std::mutex g_save_mu;  // serialises save() within the process (checkpoints are rare and large)

std::string ckpt_name(int64_t step) { return "ckpt-" + std::to_string(step) + ".safetensors"; }

// The step of "ckpt-<digits>.safetensors", or nullopt for any other name.
std::optional<int64_t> parse_ckpt_name(const std::string& name) {
  static const std::string kPrefix = "ckpt-", kSuffix = ".safetensors";
  if (name.size() <= kPrefix.size() + kSuffix.size() || name.rfind(kPrefix, 0) != 0 ||
      name.compare(name.size() - kSuffix.size(), kSuffix.size(), kSuffix) != 0)
    return std::nullopt;
  const std::string digits =
      name.substr(kPrefix.size(), name.size() - kPrefix.size() - kSuffix.size());
  if (digits.size() > 18 ||
      !std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; }))
    return std::nullopt;
  return std::stoll(digits);
}

std::string join_path(const std::string& dir, const std::string& name) {
  return (fs::path(dir) / name).string();
}

// (step, file name) of every checkpoint file in `dir`, highest step first.
std::vector<std::pair<int64_t, std::string>> list_checkpoints(const std::string& dir) {
  std::vector<std::pair<int64_t, std::string>> out;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (auto step = parse_ckpt_name(name)) out.emplace_back(*step, name);
  }
  if (ec) throw Unavailable("cannot list checkpoint directory " + dir + ": " + ec.message());
  std::sort(out.begin(), out.end(), std::greater<>());
  return out;
}

void remove_file(const std::string& path, const char* why) {
  if (::unlink(path.c_str()) == 0 || errno == ENOENT) return;
  const int err = errno;
  DTRAIN_LOG(WARNING) << "CheckpointManager: cannot remove " << why << " " << path << ": "
                      << std::strerror(err) << "; it is left in place";
}

// Leftovers of a writer killed mid-save: "ckpt-*.tmp.*" and "checkpoint.tmp.*".
void remove_temporaries(const std::string& dir) {
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if ((name.rfind("ckpt-", 0) == 0 || name.rfind(kIndexName, 0) == 0) &&
        name.find(".tmp.") != std::string::npos)
      remove_file(it->path().string(), "temporary file");
  }
}

// The checkpoint file the index names, or nullopt with *why set (empty when there is no index);
// *saved (when given): the index's checkpoints in the order they were saved, oldest first (empty
// for an index written before it kept them).
std::optional<std::string> read_index(const std::string& dir, std::string* why,
                                      std::vector<std::string>* saved = nullptr) {
  const std::string path = join_path(dir, kIndexName);
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) {
    *why = errno == ENOENT ? "" : "index " + path + " cannot be opened: " + std::strerror(errno);
    return std::nullopt;
  }
  std::string text(kMaxIndexBytes, '\0');
  ssize_t r;
  do r = ::pread(fd.get(), text.data(), text.size(), 0);
  while (r < 0 && errno == EINTR);
  if (r < 0) {
    *why = "index " + path + " cannot be read: " + std::strerror(errno);
    return std::nullopt;
  }
  text.resize(static_cast<size_t>(r));
  try {
    const ojson j = ojson::parse(text);
    const auto step = parse_ckpt_name(j.at("latest").get<std::string>());
    if (!step || j.at("step").get<int64_t>() != *step) throw std::invalid_argument("inconsistent");
    if (saved) {
      saved->clear();
      if (j.contains("all"))
        for (const auto& name : j.at("all"))
          if (parse_ckpt_name(name.get<std::string>())) saved->push_back(name.get<std::string>());
    }
    return ckpt_name(*step);
  } catch (const std::exception&) {  // json errors and our own "inconsistent"
    *why = "index " + path + " is corrupt ('" + printable(text, 100) + "')";
    return std::nullopt;
  }
}

// The directory's checkpoint files, oldest first: those the index does not list (written before
// the index kept an order, or by another manager), by step, then the index's in the order they
// were saved. Retention and restore's fallback go by it, as TensorFlow's CheckpointManager does:
// a rerun that starts again at a lower step keeps its own checkpoints, not the last run's.
std::vector<std::string> saved_order(const std::string& dir) {
  std::string why;
  std::vector<std::string> listed;
  read_index(dir, &why, &listed);
  const auto files = list_checkpoints(dir);  // highest step first
  std::vector<std::string> out;
  for (auto it = files.rbegin(); it != files.rend(); ++it)
    if (std::find(listed.begin(), listed.end(), it->second) == listed.end())
      out.push_back(it->second);
  for (const std::string& name : listed)
    if (std::any_of(files.begin(), files.end(), [&](const auto& f) { return f.second == name; }) &&
        std::find(out.begin(), out.end(), name) == out.end())
      out.push_back(name);
  return out;
}

}  // namespace

CheckpointManager::CheckpointManager(std::string directory, int max_to_keep)
    : directory_(std::move(directory)), max_to_keep_(max_to_keep) {
  if (directory_.empty()) throw InvalidArgument("CheckpointManager: the directory name is empty");
  if (max_to_keep_ < 1)
    throw InvalidArgument(detail::str_cat("CheckpointManager: max_to_keep is ", max_to_keep_,
                                          "; it must be at least 1"));
  std::error_code ec;
  fs::create_directories(directory_, ec);
  if (ec) throw Unavailable("CheckpointManager: cannot create " + directory_ + ": " + ec.message());
  if (!fs::is_directory(directory_, ec))
    throw Unavailable("CheckpointManager: " + directory_ + " exists and is not a directory");
}

std::string CheckpointManager::save(int64_t step, CheckpointData data) {
  if (step < 0)
    throw InvalidArgument(detail::str_cat("CheckpointManager::save: step ", step, " is negative"));
  std::lock_guard<std::mutex> lock(g_save_mu);
  remove_temporaries(directory_);
  data.metadata["step"] = std::to_string(step);
  const std::string name = ckpt_name(step);
  const std::string path = join_path(directory_, name);
  std::vector<std::string> order = saved_order(directory_);
  save_safetensors(path, data);  // durable before the index can name it

  order.erase(std::remove(order.begin(), order.end(), name), order.end());
  order.push_back(name);
  const size_t drop =
      order.size() > static_cast<size_t>(max_to_keep_) ? order.size() - max_to_keep_ : 0;
  ojson index = ojson::object();
  index["latest"] = name;
  index["step"] = step;
  index["all"] =
      std::vector<std::string>(order.begin() + static_cast<std::ptrdiff_t>(drop), order.end());
  const std::string text = index.dump() + "\n";
  write_atomically(join_path(directory_, kIndexName), {{text.data(), text.size()}});

  // The oldest saved go, whatever their steps (the one just written is always kept).
  for (size_t i = 0; i < drop; ++i) remove_file(join_path(directory_, order[i]), "old checkpoint");
  return path;
}

std::optional<CheckpointData> CheckpointManager::restore_latest(int64_t* step,
                                                                std::string* path) const {
  std::vector<std::string> skipped;  // "what: why", for the one warning line
  // Only a damaged or vanished file is passed over: an I/O error that may be passing (EIO, EACCES,
  // a stale NFS handle) is thrown, since on one worker of several it would quietly restore other
  // weights than the rest.
  auto try_load = [&](const std::string& name) -> std::optional<CheckpointData> {
    const int64_t s = *parse_ckpt_name(name);
    try {
      CheckpointData d = load_safetensors(join_path(directory_, name));
      auto it = d.metadata.find("step");
      if (it != d.metadata.end() && it->second != std::to_string(s))
        throw DataLoss("its metadata says step " + printable(it->second, 40));
      if (step) *step = s;
      if (path) *path = join_path(directory_, name);
      return d;
    } catch (const DataLoss& e) {
      skipped.push_back(name + " (" + e.what() + ")");
    } catch (const NotFound& e) {
      skipped.push_back(name + " (" + e.what() + ")");
    } catch (const Unimplemented& e) {  // a dtype dtrain does not hold: not one of ours
      skipped.push_back(name + " (" + e.what() + ")");
    }
    return std::nullopt;
  };

  std::string why;
  const std::optional<std::string> indexed = read_index(directory_, &why);
  if (indexed)
    if (auto d = try_load(*indexed)) return d;
  const std::vector<std::string> order = saved_order(directory_);  // oldest first
  if (!indexed && why.empty() && !order.empty()) why = "index file 'checkpoint' is missing";
  if (!why.empty()) skipped.insert(skipped.begin(), why);

  for (auto it = order.rbegin(); it != order.rend(); ++it) {
    const std::string& name = *it;
    if (indexed && name == *indexed) continue;
    if (auto d = try_load(name)) {
      std::string line;
      for (const std::string& what : skipped) line += (line.empty() ? "" : "; ") + what;
      DTRAIN_LOG(WARNING) << "CheckpointManager(" << directory_ << "): restored " << name
                          << " after skipping: " << line;
      return d;
    }
  }
  if (skipped.empty()) return std::nullopt;  // no index, no checkpoint files: a fresh directory
  std::string all;
  for (const std::string& what : skipped) all += (all.empty() ? "" : "; ") + what;
  throw DataLoss("CheckpointManager(" + directory_ + "): no checkpoint can be restored: " + all);
}

std::optional<std::string> CheckpointManager::latest_path() const {
  std::string why;
  if (auto indexed = read_index(directory_, &why)) {
    const std::string path = join_path(directory_, *indexed);
    std::error_code ec;
    if (fs::is_regular_file(path, ec)) return path;
  }
  const std::vector<std::string> order = saved_order(directory_);
  if (order.empty()) return std::nullopt;
  return join_path(directory_, order.back());
}

}  // namespace dtrain
