// The benchmark record (include/twell/bench_record.h): what new_bench_record fills in and how it
// reaches the JSON every `twell bench` writes.
#include <algorithm>
#include <set>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "twell/bench_record.h"

namespace twell {
namespace {

// Each round a permutation, the same for the same round, and over rounds every implementation
// follows every other one (a rotation would keep the neighbours of round 0).
TEST(BenchRecord, RoundOrderMixesWhoFollowsWhom) {
  constexpr size_t kCount = 4;
  std::set<std::pair<size_t, size_t>> followers;
  for (int round = 0; round < 64; ++round) {
    std::vector<size_t> order = round_order(kCount, round);
    EXPECT_EQ(order, round_order(kCount, round));
    for (size_t i = 1; i < kCount; ++i) followers.insert({order[i - 1], order[i]});
    std::sort(order.begin(), order.end());
    EXPECT_EQ(order, (std::vector<size_t>{0, 1, 2, 3}));
  }
  EXPECT_EQ(followers.size(), kCount * (kCount - 1));
  EXPECT_TRUE(round_order(0, 3).empty());
}

TEST(BenchRecord, NewRecordNamesWhatWhereWhenAndTheShape) {
  const BenchRecord r = new_bench_record("ffn", "cpu", "Some CPU", "twell", 17, 640, 1000, 0.02);
  const nlohmann::json j = to_json(r);
  EXPECT_EQ(j.at("bench"), "ffn");
  EXPECT_EQ(j.at("device"), "cpu");
  EXPECT_EQ(j.at("gpu_name"), "Some CPU");
  EXPECT_EQ(j.at("impl"), "twell");
  EXPECT_EQ(j.at("M"), 17);
  EXPECT_EQ(j.at("D"), 640);
  EXPECT_EQ(j.at("H"), 1000);
  EXPECT_EQ(j.at("target_density"), 0.02);
  EXPECT_EQ(j.at("commit"), build_commit());
  EXPECT_EQ(j.at("date"), today_utc());
  EXPECT_FALSE(r.commit.empty());
  EXPECT_EQ(r.date.size(), 10u) << "YYYY-MM-DD";
  EXPECT_EQ(new_bench_record("model", "cuda", "GPU", "dense", 1, 64, 128).target_density, 0.0);
}

}  // namespace
}  // namespace twell
