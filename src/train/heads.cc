#include "train/heads.h"

#include "dtrain/model/ops.h"
#include "dtrain/nn/losses.h"

namespace dtrain::detail {

void Tally::reset() {
  loss.reset_state();
  for (auto& e : metrics) e.metric->reset_state();
}

std::map<std::string, std::vector<double>> Tally::states() const {
  std::map<std::string, std::vector<double>> out{{"loss", loss.state()}};
  for (const auto& e : metrics) out[e.name] = e.metric->state();
  return out;
}

void Tally::set_states(const std::map<std::string, std::vector<double>>& s) {
  for (const auto& [name, state] : s) {
    if (name == "loss") loss.set_state(state);
    for (auto& e : metrics)
      if (e.name == name) e.metric->set_state(state);
  }
}

std::vector<double> Tally::flat_metric_states() const {
  std::vector<double> out;
  for (const auto& e : metrics)
    for (double v : e.metric->state()) out.push_back(v);
  return out;
}

void Tally::put_results(const std::vector<double>& flat, size_t at, const std::string& prefix,
                        std::map<std::string, double>* values) const {
  for (const auto& e : metrics) {
    const size_t n = e.metric->state().size();
    values->insert_or_assign(prefix + e.name, e.metric->result_of(std::vector<double>(
                                                  flat.begin() + static_cast<long>(at),
                                                  flat.begin() + static_cast<long>(at + n))));
    at += n;
  }
}

void Tally::put_local_results(std::map<std::string, double>* values) const {
  for (const auto& e : metrics) (*values)[e.name] = e.metric->result();
}

namespace {

LossFn sparse_cross_entropy() {
  return [](const Tensor& logits, const Tensor& labels) {
    return ops::sparse_softmax_cross_entropy(logits, labels);
  };
}

}  // namespace

Heads::Heads(const Model& model, const FitOptions& options) : inputs_(model.num_inputs()) {
  const LossFn& loss = options.loss;
  const std::vector<LossFn>& losses = options.losses;
  const std::vector<float>& loss_weights = options.loss_weights;
  const size_t outs = static_cast<size_t>(model.num_outputs());
  const std::vector<std::string> out_names = model.output_names();
  if (loss && !losses.empty())
    throw InvalidArgument("set either the loss for every output (loss) or one per output (losses)");
  if (!losses.empty() && losses.size() != outs)
    throw InvalidArgument("losses has " + std::to_string(losses.size()) + " functions but model '" +
                          model.name() + "' has " + std::to_string(outs) + " outputs");
  if (!loss_weights.empty() && loss_weights.size() != outs)
    throw InvalidArgument("loss_weights has " + std::to_string(loss_weights.size()) +
                          " values but model '" + model.name() + "' has " + std::to_string(outs) +
                          " outputs");
  const auto check_names = [&](const char* what, const auto& by_name) {
    for (const auto& entry : by_name) {
      bool known = false;
      for (const auto& n : out_names) known = known || n == entry.first;
      if (!known) {
        std::string all;
        for (const auto& n : out_names) all += (all.empty() ? "" : ", ") + n;
        throw InvalidArgument(std::string(what) + " names output '" + entry.first + "'; model '" +
                              model.name() + "' has outputs " + all);
      }
    }
  };
  const auto& by_name = options.output_losses;
  check_names("output_losses", by_name);
  check_names("output_loss_weights", options.output_loss_weights);
  if (!by_name.empty() && (loss || !losses.empty()))
    throw InvalidArgument("set output_losses (by output name) or loss/losses, not both");
  if (!options.output_loss_weights.empty() && !loss_weights.empty())
    throw InvalidArgument("set output_loss_weights (by output name) or loss_weights, not both");
  const bool user_loss = loss || !losses.empty() || !by_name.empty();
  for (size_t i = 0; i < outs; ++i) {
    LossFn f;
    float w = loss_weights.empty() ? 1.f : loss_weights[i];
    if (auto it = options.output_loss_weights.find(out_names[i]);
        it != options.output_loss_weights.end())
      w = it->second;
    if (!by_name.empty()) {
      auto it = by_name.find(out_names[i]);
      // Keras: an output missing from the dict is not trained on (its loss stays empty).
      if (it != by_name.end()) {
        f = it->second;
        if (!f) throw InvalidArgument("output_losses['" + out_names[i] + "'] is empty");
      }
    } else {
      f = !losses.empty() ? losses[i] : loss ? loss : sparse_cross_entropy();
      if (!f) throw InvalidArgument("losses[" + std::to_string(i) + "] is empty");
    }
    losses_.push_back(std::move(f));
    weights_.push_back(w);
  }
  // Keras compile(): no metrics unless asked, except that dtrain's default (classification) loss
  // reports accuracy. With several outputs each metric is computed for each output, named
  // "<output>_<metric>" as Keras names them.
  for (const auto& [out, list] : options.output_metrics) {
    bool known = false;
    for (const auto& n : out_names) known = known || n == out;
    if (!known) {
      std::string all;
      for (const auto& n : out_names) all += (all.empty() ? "" : ", ") + n;
      throw InvalidArgument("output_metrics names output '" + out + "'; model '" + model.name() +
                            "' has outputs " + all);
    }
  }
  std::vector<std::string> names = options.metrics;
  if (names.empty() && !user_loss) names = {"accuracy"};
  for (size_t i = 0; i < outs; ++i) {
    const std::vector<std::string>* list = &names;
    if (!options.output_metrics.empty()) {
      auto it = options.output_metrics.find(out_names[i]);
      static const std::vector<std::string> none;
      list = it == options.output_metrics.end() ? &none : &it->second;
    }
    for (const auto& n : *list) {
      make_metric(n);  // throws for an unknown name, listing the known ones
      metric_specs_.push_back({i, n, outs > 1 ? out_names[i] + "_" + n : n});
    }
  }
}

std::unique_ptr<Tally> Heads::make_tally() const {
  auto t = std::make_unique<Tally>();
  for (const auto& m : metric_specs_)
    t->metrics.push_back({m.output, m.logged, make_metric(m.name)});
  return t;
}

std::vector<Tensor> Heads::inputs(const std::vector<Tensor>& batch) const {
  const size_t need = static_cast<size_t>(inputs_) + losses_.size();
  if (batch.size() < need)
    throw InvalidArgument("the dataset gives " + std::to_string(batch.size()) +
                          " components a row, but the model takes " + std::to_string(inputs_) +
                          " inputs and has " + std::to_string(losses_.size()) +
                          " outputs to score: give the inputs, then one label per output");
  return {batch.begin(), batch.begin() + inputs_};
}

std::vector<Tensor> Heads::forward(Model& model, const std::vector<Tensor>& batch,
                                   bool training) const {
  std::vector<Tensor> outs = model(inputs(batch), training);
  if (outs.size() != losses_.size())
    throw InvalidArgument("model '" + model.name() + "' returned " + std::to_string(outs.size()) +
                          " outputs; it declares " + std::to_string(losses_.size()));
  return outs;
}

Tensor Heads::average_loss(const std::vector<Tensor>& outs, const std::vector<Tensor>& batch,
                           int64_t global_rows) const {
  Tensor total;
  for (size_t i = 0; i < outs.size(); ++i) {
    if (!losses_[i]) continue;  // an output without a loss
    Tensor l = compute_average_loss(losses_[i](outs[i], labels(batch, i)), global_rows);
    if (weights_[i] != 1.f) l = ops::scale(l, weights_[i]);
    total = total.defined() ? ops::add(total, l) : l;
  }
  return total;
}

double Heads::loss_sum(const std::vector<Tensor>& outs, const std::vector<Tensor>& batch) const {
  double total = 0;
  for (size_t i = 0; i < outs.size(); ++i)
    if (losses_[i])
      total += weights_[i] *
               ops::sum(losses_[i](outs[i], labels(batch, i))).to(DeviceSpec::cpu()).item();
  return total;
}

void Heads::update_metrics(Tally& tally, const std::vector<Tensor>& outs,
                           const std::vector<Tensor>& batch) const {
  for (auto& e : tally.metrics)
    e.metric->update_state(ops::stop_gradient(outs[e.output]), labels(batch, e.output));
}

}  // namespace dtrain::detail
