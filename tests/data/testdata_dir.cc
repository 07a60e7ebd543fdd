#include "data/testdata_dir.h"

namespace dtrain::testing {
std::string testdata_dir() { return DTRAIN_TEST_DATA_DIR; }
}  // namespace dtrain::testing
