#pragma once
#include <string>

namespace dtrain::testing {
// tests/data/testdata in the checkout (TFRecord and JPEG files other tools wrote). Only
// testdata_dir.cc's compile line carries the absolute path, so that the test's other files compile
// the same in every checkout (ccache).
std::string testdata_dir();
}  // namespace dtrain::testing
