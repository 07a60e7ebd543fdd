// "<name> key=value key=value ..." lines: optimizer and schedule configs. Values are numbers (or
// ';'-separated lists of numbers); a key given twice, a key nobody asked for, or a value that is
// not a number is an InvalidArgument naming the line.
#pragma once

#include <cstdint>
#include <cstdio>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "dtrain/core/error.h"
#include "dtrain/core/strings.h"

namespace dtrain::detail {

class ConfigLine {
 public:
  ConfigLine(std::string line, const char* what) : line_(std::move(line)), what_(what) {
    std::istringstream in(line_);
    in >> name_;
    std::string item;
    while (in >> item) {
      const size_t eq = item.find('=');
      if (eq == std::string::npos || eq == 0 || eq + 1 == item.size())
        throw error("'" + item + "' is not key=value");
      if (!values_.emplace(item.substr(0, eq), item.substr(eq + 1)).second)
        throw error("key '" + item.substr(0, eq) + "' given twice");
    }
    if (name_.empty()) throw error("it is empty");
  }
  const std::string& name() const { return name_; }

  double number(const std::string& key, double fallback) {
    auto it = values_.find(key);
    if (it == values_.end()) return fallback;
    const double v = parse(key, it->second);
    values_.erase(it);
    return v;
  }
  std::vector<double> numbers(const std::string& key) {
    auto it = values_.find(key);
    if (it == values_.end()) throw error("key '" + key + "' is required");
    std::vector<double> out;
    for (std::string_view s : split_list(it->second, ';'))
      out.push_back(parse(key, std::string(s)));
    values_.erase(it);
    return out;
  }
  // Throws for keys nobody took.
  void finish(const std::string& known) const {
    if (!values_.empty())
      throw error("unknown key '" + values_.begin()->first + "' for '" + name_ +
                  "' (keys: " + known + ")");
  }
  InvalidArgument error(const std::string& problem) const {
    return InvalidArgument(std::string("malformed ") + what_ + " '" + line_ + "': " + problem);
  }

 private:
  double parse(const std::string& key, const std::string& s) const {
    char* end = nullptr;
    const double v = std::strtod(s.c_str(), &end);
    if (s.empty() || end != s.c_str() + s.size())
      throw error("value of '" + key + "' is not a number: '" + s + "'");
    return v;
  }
  std::string line_;
  const char* what_;
  std::string name_;
  std::map<std::string, std::string> values_;
};

// " key=value" with enough digits to round-trip a float.
inline std::string kv(const char* key, double v) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), " %s=%.9g", key, v);
  return buf;
}

}  // namespace dtrain::detail
