// Which commit an elastic round rebuilds, and from whom (src/train/elastic_state.h). The
// multi-process behaviour (kill -9, exact rollback under each ZeRO stage) is in
// tests/elastic/elastic_test.py.
#include "train/elastic_state.h"

#include <gtest/gtest.h>

#include "dtrain/core/error.h"

namespace dtrain::elastic::detail {
namespace {

CommitTag tag(int64_t step, int workers, int rank, int copies, int64_t round = 1) {
  return CommitTag{round, step, workers, rank, copies};
}

TEST(PlanRestore, NothingCommittedYet) { EXPECT_FALSE(plan_restore({{}, {}, {}}).has_value()); }

TEST(PlanRestore, UnshardedAnySurvivorHoldsEverything) {
  // Old rank 0 of 3 left; old ranks 1 and 2 are the new 0 and 1; a newcomer is new rank 2.
  const auto p = plan_restore({{tag(40, 3, 1, 3)}, {tag(40, 3, 2, 3)}, {}});
  ASSERT_TRUE(p.has_value());
  EXPECT_EQ(p->commit.global_step, 40);
  EXPECT_EQ(p->source, 0);
  EXPECT_EQ(p->commit.rank, 1);
  // Pieces spread over both holders, none from the newcomer.
  EXPECT_EQ(p->piece_from, (std::vector<int>{0, 1, 0}));
  EXPECT_EQ(p->piece_slot, (std::vector<int>{0, 0, 1}));
  EXPECT_EQ(p->slots, 2);
  // Holder r keeps pieces rank, rank + 1, ...: old rank 1 keeps piece 0 as its third (index 2).
  EXPECT_EQ(p->piece_index, (std::vector<int>{2, 2, 1}));
}

TEST(PlanRestore, ShardedPieceOfALeaverComesFromItsNeighbour) {
  // 3 workers keeping 2 pieces each (their own and the next one's); old rank 0 left.
  const auto p = plan_restore({{tag(40, 3, 1, 2)}, {tag(40, 3, 2, 2)}});
  ASSERT_TRUE(p.has_value());
  EXPECT_EQ(p->piece_from[0], 1);  // old rank 2 keeps piece 0 as its second
  EXPECT_EQ(p->piece_index[0], 1);
  EXPECT_EQ(p->piece_from[1], 0);  // old rank 1's own
  EXPECT_EQ(p->piece_index[1], 0);
}

TEST(PlanRestore, TwoNeighboursLostTogetherIsDataLossNamingThePiece) {
  // 4 workers, 2 pieces each; old ranks 1 and 2 left together: piece 2 was on them only.
  try {
    plan_restore({{tag(40, 4, 0, 2)}, {tag(40, 4, 3, 2)}});
    FAIL() << "rebuilt a commit with a piece missing";
  } catch (const DataLoss& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("global step 40"), std::string::npos) << m;
    EXPECT_NE(m.find("lost piece(s) 2:"), std::string::npos) << m;
    EXPECT_NE(m.find("BackupAndRestore"), std::string::npos) << m;
  }
}

TEST(PlanRestore, FallsBackToTheCommitBeforeOneThatIsIncomplete) {
  // Old rank 2 died during the commit of step 50: old rank 0 finished it, old rank 1 did not (it
  // still holds step 40 only). Piece 2 of step 50 was on old ranks 2 and 1: lost; step 40 is whole.
  const auto p = plan_restore({{tag(50, 3, 0, 2), tag(40, 3, 0, 2)}, {tag(40, 3, 1, 2)}});
  ASSERT_TRUE(p.has_value());
  EXPECT_EQ(p->commit.global_step, 40);
  EXPECT_EQ(p->piece_from[2], 1);
}

TEST(PlanRestore, PrefersTheNewestStepThenTheNewestRound) {
  // A round re-formed at step 40 (round 2, 2 workers) and one worker of it finished its commit;
  // the other still holds round 1's. Both are whole: round 2's is taken.
  const auto p = plan_restore({{tag(40, 2, 0, 2, 2), tag(40, 3, 1, 3, 1)}, {tag(40, 3, 2, 3, 1)}});
  ASSERT_TRUE(p.has_value());
  EXPECT_EQ(p->commit.round, 2);
  EXPECT_EQ(p->piece_from, (std::vector<int>{0, 0}));
}

TEST(ContentHash, SeesEveryByteAndTheLength) {
  Tensor a = Tensor::from_vector<float>({1, 2, 3, 4, 5}, Shape{5});
  Tensor b = a.clone();
  EXPECT_EQ(content_hash(a), content_hash(b));
  b.data<float>()[4] = 5.0000005f;  // the tail past the last whole 8-byte word
  EXPECT_NE(content_hash(a), content_hash(b));
  b = a.clone();
  b.data<float>()[0] = -1.f;
  EXPECT_NE(content_hash(a), content_hash(b));
  EXPECT_NE(content_hash(a.slice_rows(0, 4)), content_hash(a));
}

}  // namespace
}  // namespace dtrain::elastic::detail
