// Private to src/strategies: installs a strategy and replica context on a replica thread.
#pragma once

#include "dtrain/strategies/strategy.h"

namespace dtrain::detail {

// While alive, the calling thread is "inside run()" as replica `ctx` of `strategy`.
class ReplicaThreadScope {
 public:
  ReplicaThreadScope(Strategy* strategy, ReplicaContext* ctx);
  ~ReplicaThreadScope();
  ReplicaThreadScope(const ReplicaThreadScope&) = delete;
  ReplicaThreadScope& operator=(const ReplicaThreadScope&) = delete;

 private:
  ReplicaContext* saved_ctx_;
  const VariableCreator* saved_running_ = nullptr;
  size_t saved_depth_;
  VariableCreatorScope creator_scope_;
};

// The process-wide default strategy (one replica on CPU:0).
Strategy& default_strategy();

}  // namespace dtrain::detail
