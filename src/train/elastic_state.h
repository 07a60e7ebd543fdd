// The state an elastic job commits and restores (elastic.cc). Private to src/train.
//
// Each worker keeps its commits in pieces: the commit's entries (every variable, slot and count of
// Checkpoint::capture) are cut into `workers` flat pieces (partition_range), and worker w keeps
// pieces w, w+1, ..., w+copies-1 (mod workers). Unsharded jobs keep every piece (copies ==
// workers: any one survivor can restore, Horovod's in-memory state); sharded jobs (ZeRO) keep two
// (their own and the next worker's: 2/N of the state, any one worker may leave at a time), since a
// whole copy on every worker would undo the sharding. A restore rebuilds each entry from the
// pieces the workers of the new round hold (one all-gather per entry), checks it against the hash
// taken at commit, and gives it to Checkpoint::restore, one entry at a time.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "dtrain/core/tensor.h"
#include "dtrain/train/callbacks.h"
#include "dtrain/train/checkpoint.h"

namespace dtrain {
class MultiWorkerMirroredStrategy;
}

namespace dtrain::elastic::detail {

// Where a commit was taken: the round and global step, its worker count, the holder's rank in that
// round and how many consecutive pieces each worker keeps.
struct CommitTag {
  int64_t round = 0;
  int64_t global_step = 0;
  int workers = 0;
  int rank = 0;
  int copies = 0;
  bool same_commit(const CommitTag& o) const {
    return round == o.round && global_step == o.global_step && workers == o.workers &&
           copies == o.copies;
  }
};

// How the workers of a new round rebuild one commit.
struct RestorePlan {
  CommitTag commit;              // the commit chosen (rank: that of `source` in its round)
  int source = 0;                // the new rank that sends the metadata and entry list
  std::vector<int> piece_from;   // per piece k: the new rank that sends it
  std::vector<int> piece_index;  // per piece k: which of that worker's pieces it is (0..copies-1)
  std::vector<int> piece_slot;   // per piece k: its place in its sender's buffer
  int slots = 0;                 // pieces the busiest sender sends
};

// held[r]: the commits new rank r holds (newcomers: none). Chooses the newest commit (global step,
// then round) whose every piece some worker holds, spreading the pieces over their holders.
// nullopt when no worker holds a commit; DataLoss naming the lost pieces when commits exist but
// none can be rebuilt.
std::optional<RestorePlan> plan_restore(const std::vector<std::vector<CommitTag>>& held);

// A 64-bit hash of a tensor's bytes (FNV-1a over 8-byte words).
uint64_t content_hash(const Tensor& t);

class CommittedState {
 public:
  CommittedState(MultiWorkerMirroredStrategy& strategy, Model& model, Optimizer& optimizer);

  // Commits the current state at `p` in round `round` (collective under sharding: the sharded
  // entries are gathered whole one at a time). The commit before it is kept while the new one may
  // be incomplete on some worker (sharded jobs); an unsharded commit is local.
  // `first`: the job's first commit, kept whole by rank 0 alone (the job starts from its state).
  // `callbacks`: the callbacks' states (Callback::state_dict), committed with the rest.
  void commit(int64_t round, const TrainingPosition& p,
              const std::map<std::string, std::string>& extra = {}, bool first = false,
              const std::map<std::string, CallbackState>& callbacks = {});
  // Rebuilds the newest commit the workers of `round` hold between them and restores it on every
  // worker (collective); when none holds one (the job's start), rank 0 commits its state first.
  // The rebuilt state becomes this worker's commit for the new round. Returns the position.
  // `callbacks`: the callbacks' states that commit holds.
  TrainingPosition restore(int64_t round, std::map<std::string, std::string>* metadata,
                           std::map<std::string, CallbackState>* callbacks);

 private:
  struct Entry {
    std::string name;
    DType dtype = DType::kFloat32;
    Shape shape;
    uint64_t hash = 0;
    std::vector<Tensor> pieces;  // flat, on the host: pieces rank, rank + 1, ... of the commit
  };
  struct Held {
    CommitTag tag;
    std::map<std::string, std::string> metadata;
    std::vector<Entry> entries;
  };
  // `whole` cut into the pieces `tag`'s worker keeps (copies on the host).
  Entry keep(const std::string& name, const Tensor& whole, const CommitTag& tag) const;
  // Entry `index` (declared `d` by the plan's source) whole again from the pieces of `plan`, with
  // one all-gather (collective); checked against its hash and kept in `next`'s pieces.
  Tensor rebuild(const RestorePlan& plan, const Held* mine, const Entry& d, size_t index,
                 Held& next);
  MultiWorkerMirroredStrategy& strategy_;
  Model& model_;
  Optimizer& optimizer_;
  std::optional<Held> current_, previous_;
};

}  // namespace dtrain::elastic::detail
