#include "dtrain/train/sidecar_evaluator.h"

#include <cstring>
#include <filesystem>
#include <set>
#include <thread>

#include "dtrain/devices/device.h"

namespace dtrain {

SidecarEvaluator::SidecarEvaluator(Model& model, Dataset test, SidecarEvaluatorOptions options)
    : model_(model), test_(std::move(test)), o_(std::move(options)) {
  if (!model_.built())
    throw InvalidArgument("SidecarEvaluator: build the model first (model.build(input_shape))");
  if (o_.checkpoint_dir.empty())
    throw InvalidArgument(
        "SidecarEvaluator needs the training job's checkpoint directory (--checkpoint-dir)");
}

void SidecarEvaluator::load_into(Model& model, const CheckpointData& data) {
  std::set<std::string>
      used;  // ParameterServerStrategy's naming: the first free of name, name_1, name_2...
  for (const auto& var : model.variables()) {
    std::string key = var->name();
    for (int n = 1; used.count(key); ++n) key = var->name() + "_" + std::to_string(n);
    used.insert(key);
    Tensor value;
    if (const Tensor* whole = data.find(key)) {
      value = *whole;
    } else if (data.find(key + "/part_0")) {
      std::vector<const Tensor*> parts;
      for (int i = 0; const Tensor* p = data.find(key + "/part_" + std::to_string(i)); ++i)
        parts.push_back(p);
      int64_t rows = 0;
      for (const Tensor* p : parts) rows += p->rank() > 0 ? p->shape()[0] : 0;
      if (var->shape().rank() == 0 || rows != var->shape()[0])
        throw InvalidArgument("checkpoint shards of '" + key + "' hold " + std::to_string(rows) +
                              " rows; the model's variable is " + var->shape().to_string());
      value = Tensor::empty(var->shape(), var->dtype());
      int64_t row = 0;
      for (const Tensor* p : parts) {
        value.slice_rows(row, row + p->shape()[0]).copy_from(*p);
        row += p->shape()[0];
      }
    } else {
      throw NotFound(
          "the checkpoint has no variable '" + key +
          "': was it written by a job training the same model (same layers, same order)?");
    }
    if (value.shape() != var->shape() || value.dtype() != var->dtype())
      throw InvalidArgument("checkpoint variable '" + key + "' is " + value.to_string() +
                            " but the model's is " + var->shape().to_string());
    var->assign(value.to(var->value().device()));
  }
}

std::vector<SidecarResult> SidecarEvaluator::run() {
  CheckpointManager manager(o_.checkpoint_dir);
  std::vector<SidecarResult> results;
  // A checkpoint is new when the file the index names is another file than the one last
  // evaluated (file_source: path, inode, modification time, size): the chief's final checkpoint
  // replaces the file of its last step, possibly within one timestamp tick. What counts as seen is
  // the file the load read (CheckpointData::source), not the path's file after the load, which may
  // already be the final one.
  // Also the file the index named when it was loaded: where that file does not load,
  // restore_latest() falls back to an older one, which must not be evaluated again and again.
  std::string last_seen, last_named;
  auto last_change = std::chrono::steady_clock::now();
  for (;;) {
    const bool stopping = o_.stop && o_.stop->load();
    const std::optional<std::string> path = manager.latest_path();
    const std::string named = path ? file_source(*path) : std::string();
    if (path && named != last_seen && named != last_named) {
      int64_t step = 0;
      std::optional<CheckpointData> data = manager.restore_latest(&step);
      if (data) {
        last_seen = data->source;
        last_named = named;
        last_change = std::chrono::steady_clock::now();
        load_into(model_, *data);
        SidecarResult r;
        r.step = step;
        auto it = data->metadata.find("final");
        r.final = it != data->metadata.end() && it->second == "1";
        r.eval = evaluate(get_strategy(), model_, test_, o_.batch_size);
        results.push_back(r);
        if (o_.out) {
          if (o_.json)
            std::fprintf(o_.out,
                         "{\"evaluator_step\": %lld, \"final\": %s, \"test_accuracy\": %.6f, "
                         "\"test_loss\": %.6f}\n",
                         static_cast<long long>(step), r.final ? "true" : "false", r.eval.accuracy,
                         r.eval.loss);
          else
            std::fprintf(o_.out,
                         "evaluator: checkpoint at global step %lld%s: test accuracy %.2f%%, test "
                         "loss %.4f\n",
                         static_cast<long long>(step), r.final ? " (final)" : "",
                         100 * r.eval.accuracy, r.eval.loss);
          std::fflush(o_.out);
        }
        if (r.final) return results;
        continue;  // look again at once: a newer one may have landed meanwhile
      }
    }
    if (stopping) return results;
    if (std::chrono::steady_clock::now() - last_change >= o_.timeout)
      throw DeadlineExceeded(
          "evaluator: no new checkpoint in " + o_.checkpoint_dir + " for " +
          std::to_string(std::chrono::duration_cast<std::chrono::seconds>(o_.timeout).count()) +
          " s; is the chief running with the same --checkpoint-dir?");
    std::this_thread::sleep_for(o_.poll);
  }
}

}  // namespace dtrain
