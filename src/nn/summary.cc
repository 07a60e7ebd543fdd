// Model::summary(): Keras' table.
#include <cstdio>
#include <iostream>
#include <ostream>
#include <set>

#include "dtrain/nn/model.h"
#include "nn/graph_node.h"

namespace dtrain {
namespace {

std::string grouped(int64_t n) {  // 25636712 -> "25,636,712"
  std::string s = std::to_string(n), out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (i > 0 && (s.size() - i) % 3 == 0) out += ',';
    out += s[i];
  }
  return out;
}

std::string bytes(int64_t n) {  // Keras: 4 bytes a parameter, in binary units
  const char* unit[] = {"B", "KB", "MB", "GB", "TB"};
  double v = static_cast<double>(n);
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f %s", v, unit[u]);
  return buf;
}

std::string shape_text(const std::vector<Shape>& shapes) {
  if (shapes.empty()) return "?";
  std::string out;
  for (size_t i = 0; i < shapes.size(); ++i) {
    if (i) out += ", ";
    out += "(None";
    for (int64_t d : shapes[i].dims()) out += ", " + std::to_string(d);
    out += ")";
  }
  return out;
}

// Pads to `width` (or, when the text is longer, keeps it whole and adds one space).
std::string cell(const std::string& s, size_t width) {
  return s.size() < width ? s + std::string(width - s.size(), ' ') : s + " ";
}

}  // namespace

void Model::summary(std::ostream& out) const {
  const bool graph = functional();
  const size_t w1 = 36, w2 = 24, w3 = 12, w4 = graph ? 28 : 0;
  const std::string rule(w1 + w2 + w3 + w4, '_'), thick(w1 + w2 + w3 + w4, '=');
  out << "Model: \"" << name() << "\"\n" << rule << "\n";
  out << cell(" Layer (type)", w1) << cell("Output Shape", w2) << cell("Param #", w3);
  if (graph) out << "Connected to";
  out << "\n" << thick << "\n";
  auto row = [&](const std::string& layer, const std::string& shape, int64_t params,
                 const std::string& connected) {
    out << cell(" " + layer, w1) << cell(shape, w2) << cell(grouped(params), w3);
    if (graph) out << connected;
    out << "\n";
  };
  if (graph) {
    for (const auto& in : graph_inputs_)
      row(in.node_->input_name + " (InputLayer)", shape_text({in.shape()}), 0, "-");
    std::set<const Layer*> shown;
    auto source = [](const KerasTensor& k) {
      return k.node_->layer ? k.node_->layer->name() : k.node_->input_name;
    };
    for (const auto& n : nodes_) {
      std::string connected;
      for (const auto& k : n->inputs)
        connected += (connected.empty() ? "" : ", ") + source(k) + "[" +
                     std::to_string(k.output_index()) + "]";
      const bool again = !shown.insert(n->layer.get()).second;
      row(n->layer->name() + " (" + n->layer->class_name() + ")", shape_text(n->shapes),
          again ? 0 : n->layer->count_params(), connected);
    }
  } else {
    for (const auto& l : layers())
      row(l->name() + " (" + l->class_name() + ")", shape_text(l->output_shapes()),
          l->count_params(), "");
  }
  int64_t total = 0, trainable = 0;
  for (const auto& v : variables()) total += v->shape().numel();
  for (const auto& v : trainable_variables()) trainable += v->shape().numel();
  out << thick << "\n";
  out << " Total params: " << grouped(total) << " (" << bytes(total * 4) << ")\n";
  out << " Trainable params: " << grouped(trainable) << " (" << bytes(trainable * 4) << ")\n";
  out << " Non-trainable params: " << grouped(total - trainable) << " ("
      << bytes((total - trainable) * 4) << ")\n";
  out << rule << "\n";
}

void Model::summary() const { summary(std::cout); }

}  // namespace dtrain
