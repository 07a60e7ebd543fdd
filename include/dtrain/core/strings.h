// split_list: the one comma-list splitter used by every flag and variable parser (the --devices
// GPU list, SLURM node lists and task counts, dtrain-run's -H, dtrain-bench's --sizes).
// Header-only, so tools that do not link libdtrain (dtrain-run) use it too. Thread-safety: a pure
// function.
#pragma once

#include <string_view>
#include <vector>

namespace dtrain {

// "a,b,,c" -> {"a", "b", "", "c"}; "" -> {""}. Empty items are kept so that callers can refuse them
// with a message that quotes the whole list. The views point into `text`.
inline std::vector<std::string_view> split_list(std::string_view text, char separator = ',') {
  std::vector<std::string_view> out;
  size_t start = 0;
  for (;;) {
    const size_t end = text.find(separator, start);
    if (end == std::string_view::npos) {
      out.push_back(text.substr(start));
      return out;
    }
    out.push_back(text.substr(start, end - start));
    start = end + 1;
  }
}

}  // namespace dtrain
