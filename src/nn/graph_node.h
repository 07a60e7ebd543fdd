// Private to src/nn: a node of a functional graph, what a KerasTensor points at.
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/nn/layer.h"

namespace dtrain::detail {

struct Node {
  int64_t id = 0;                // creation order: a node's inputs always have smaller ids
  std::shared_ptr<Layer> layer;  // nullptr: an Input
  std::string input_name;        // an Input's name
  std::vector<KerasTensor> inputs;
  std::vector<Shape> shapes;  // per-example output shapes
  std::vector<DType> dtypes;

  static int64_t next_id() {
    static std::atomic<int64_t> id{1};
    return id.fetch_add(1);
  }
};

}  // namespace dtrain::detail
