// Elastic training (Horovod elastic, torchrun's rendezvous) with MultiWorkerMirroredStrategy: the
// reference CNN on Fashion-MNIST keeps training when workers die or join.
//
//   dtrain-run --min-np 2 --max-np 3 -np 3 --host-discovery-script ./hosts.sh --
//   ./elastic_fashion_mnist
//
// Kill a worker (kill -9) and the others roll back to the last commit, re-form and go on; list
// another slot in the discovery script and a new worker starts, receives the committed state by
// broadcast and is taken in at the next commit. --sharding shards the optimizer state (and more)
// across the workers; the commits then keep each piece of the state on two neighbouring workers.
// The global batch (--batch-size) stays the same whatever the number of workers, so the learning
// rate stays too (see dtrain/train/elastic.h); --lr-decay adds a LearningRateScheduler, whose state
// the commits carry.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <optional>

#include "../fashion_mnist/reference_cnn.h"
#include "dtrain/dtrain.h"

// --exit-at-step: a worker that dies between two commits, at a step the test chooses.
class ExitAtStep final : public dtrain::Callback {
 public:
  ExitAtStep(const dtrain::elastic::Job& job, int64_t step, int rank)
      : job_(job), step_(step), rank_(rank) {}
  void on_train_batch_end(const dtrain::TrainLogs& logs) override {
    if (step_ > 0 && logs.global_step == step_ && job_.membership().generation == 1 &&
        job_.membership().rank == rank_) {
      std::fprintf(stderr, "exiting at global step %lld (--exit-at-step)\n",
                   static_cast<long long>(step_));
      std::fflush(nullptr);
      std::_Exit(3);
    }
  }

 private:
  const dtrain::elastic::Job& job_;
  int64_t step_;
  int rank_;
};

int main(int argc, char** argv) {
  CLI::App app{"elastic MultiWorkerMirrored training of the reference CNN on Fashion-MNIST"};
  int epochs = 3;
  int64_t batch = 96, train_limit = 0, commit_every = 10, exit_at = 0;
  int exit_rank = 1;
  float lr = 1e-3f;
  double lr_decay = 1;
  int patience = 0;
  double warmup_epochs = 0;
  bool patience_rank0_only = false, keep_last_weights = false;
  uint64_t seed = 42;
  bool json = false;
  std::string data_dir, devices = "cpu", sharding = "none";
  app.add_option("--epochs", epochs, "epochs to train")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--batch-size", batch, "global batch, split over the workers of each round")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--lr", lr, "Adam learning rate")->capture_default_str();
  app.add_option("--lr-decay", lr_decay,
                 "multiply the learning rate by this at each epoch's start "
                 "(LearningRateScheduler; 1: none)")
      ->check(CLI::Range(1e-6, 1.0))
      ->capture_default_str();
  app.add_option("--patience", patience,
                 "EarlyStopping on val_loss with this patience, restoring the best epoch's "
                 "weights at the end (0: none)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--warmup-epochs", warmup_epochs,
                 "Horovod's gradual warm-up over this many epochs (LearningRateWarmup; 0: none)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_flag("--keep-last-weights", keep_last_weights,
               "the EarlyStopping of --patience keeps the last epoch's weights instead");
  app.add_flag("--patience-rank0-only", patience_rank0_only,
               "fault tests: give the EarlyStopping to rank 0 alone (wrong: the commits would "
               "differ; fit() refuses when it starts, or with --keep-last-weights elastic::run "
               "does)");
  app.add_option("--commit-every", commit_every, "batches between commits")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--seed", seed, "seed for weights and shuffling")->capture_default_str();
  app.add_option("--devices", devices, "this worker's devices, e.g. cpu or cpu:2")
      ->capture_default_str();
  app.add_option(
         "--sharding", sharding,
         "ZeRO stage: none, optimizer_state (1), gradients (2), parameters (3: every layer is "
         "a unit)")
      ->capture_default_str();
  app.add_option("--data-dir", data_dir, "Fashion-MNIST IDX directory");
  app.add_option("--train-limit", train_limit, "train on the first N images only (tests)");
  app.add_option(
      "--exit-at-step", exit_at,
      "fault tests: in the first round, the worker of rank --exit-rank exits abruptly "
      "(status 3) once global step N is done; the others roll back to their last commit");
  app.add_option("--exit-rank", exit_rank, "see --exit-at-step")->capture_default_str();
  app.add_flag("--json", json,
               "the last round's rank 0 prints one JSON object with the results as the last line");
  CLI11_PARSE(app, argc, argv);
  try {
    dtrain::elastic::Job job;
    dtrain::MirroredOptions local;
    local.devices = dtrain::parse_devices_flag(devices, 1);
    local.sharding = dtrain::parse_sharding(sharding);
    dtrain::CommunicationOptions comm;
    comm.connect_timeout =
        std::chrono::seconds(30);  // a round whose member dies while connecting re-forms sooner
    comm.broadcast_initial_values = false;  // elastic::run broadcasts the state (newcomers too)
    dtrain::ClusterResolution cluster =
        job.join();  // before job.token(): the token belongs to the round
    dtrain::MultiWorkerMirroredStrategy strategy(local, comm, cluster, job.token());

    dtrain::set_global_seed(seed);
    dtrain::FashionMnist data = dtrain::load_fashion_mnist(data_dir, train_limit);
    if (train_limit > 0 && train_limit < data.train_images.shape()[0]) {
      data.train_images = data.train_images.slice_rows(0, train_limit);
      data.train_labels = data.train_labels.slice_rows(0, train_limit);
    }
    const auto train = dtrain::Dataset::from_tensors({data.train_images, data.train_labels});
    const auto test = dtrain::Dataset::from_tensors({data.test_images, data.test_labels});
    dtrain::Sequential model;
    std::unique_ptr<dtrain::Adam> opt;
    {
      auto scope = strategy.scope();
      model = dtrain::examples::reference_cnn();
      if (local.sharding == dtrain::Sharding::kParameters)
        for (const auto& layer : model.layers()) layer->set_shard_parameters(true);
      std::vector<int64_t> input = data.train_images.shape().dims();
      input[0] = 1;
      model.build(dtrain::Shape(input));  // the state elastic::run commits and broadcasts
      opt = std::make_unique<dtrain::Adam>(lr);
    }
    dtrain::History history;
    ExitAtStep exit_at_step(job, exit_at, exit_rank);
    // Its state (the rate its last epoch started with) is committed with the model: after a reset
    // survivors and newcomers go on with the rate an uninterrupted job would have.
    dtrain::LearningRateScheduler decay([lr_decay](int, double rate) { return rate * lr_decay; });
    std::optional<dtrain::LearningRateWarmup> warmup;
    if (warmup_epochs > 0) warmup.emplace(warmup_epochs);
    dtrain::EarlyStopping stop("val_loss", 0, patience, dtrain::MonitorMode::kAuto,
                               /*restore_best_weights=*/!keep_last_weights);
    dtrain::elastic::RunOptions ro;
    ro.commit_every = commit_every;
    // On every worker of a new round, newcomers too, after the restore: where a program would
    // rescale the rate for the new size (Horovod's convention).
    ro.on_reset = [&](const dtrain::elastic::Membership& m) {
      std::fprintf(stderr, "elastic: round %d, %zu workers, %d replicas in sync (rank %d)\n",
                   m.generation, m.addresses.size(), strategy.num_replicas_in_sync(), m.rank);
    };
    const dtrain::elastic::RunReport report = dtrain::elastic::run(
        job, strategy, model, *opt,
        [&](dtrain::Callback& elastic) {
          dtrain::ProgressBar progress(json ? stderr : stdout);
          dtrain::FitOptions fit;
          fit.epochs = epochs;
          fit.global_batch_size = batch;
          fit.shuffle_seed = seed;
          fit.callbacks = {&elastic, &exit_at_step};
          if (lr_decay < 1) fit.callbacks.push_back(&decay);
          if (warmup) fit.callbacks.push_back(&*warmup);
          if (patience > 0 && (!patience_rank0_only || job.membership().rank == 0))
            fit.callbacks.push_back(&stop);
          if (strategy.extended().is_chief()) fit.callbacks.push_back(&progress);
          dtrain::History h = dtrain::fit(strategy, model, *opt, train, &test, fit);
          if (!h.history["loss"].empty())
            history = h;  // a resumed call may find nothing left to train
        },
        ro);
    // Every worker of the last round must hold the same rate and weights (a worker that went on
    // with other values would train another model, silently): one sum across the workers.
    double checksum = 0;
    if (local.sharding != dtrain::Sharding::kParameters)  // ZeRO-3: each holds its part
      for (const auto& v : model.variables())
        for (float x : v->value().to(dtrain::DeviceSpec::cpu()).to_vector<float>()) checksum += x;
    // Rank 0's values to all (a sum with one term that is not zero is exact), then the number of
    // workers whose values differ from them.
    const double rate = opt->learning_rate();
    const bool first = strategy.extended().worker_rank() == 0;
    const std::vector<double> chief =
        strategy.extended().sum_across_workers({first ? rate : 0.0, first ? checksum : 0.0});
    const bool same = rate == chief[0] && checksum == chief[1];
    const bool agree = strategy.extended().sum_across_workers({same ? 0.0 : 1.0})[0] == 0;
    if (json && strategy.extended().is_chief()) {
      nlohmann::json j{{"example", "elastic_fashion_mnist"},
                       {"workers", report.workers},
                       {"rounds", report.generation},
                       {"resets", report.resets},
                       {"rolled_back_steps", report.rolled_back},
                       {"global_batch", batch},
                       {"optimizer_steps", opt->iterations()},
                       {"learning_rate", opt->learning_rate()},
                       {"workers_agree", agree},
                       {"best_epoch", patience > 0 ? stop.best_epoch() : -1},
                       {"final_loss", history.history.at("loss").back()},
                       {"test_accuracy", history.history.at("val_accuracy").back()}};
      std::printf("%s\n", j.dump().c_str());
    }
  } catch (const dtrain::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
