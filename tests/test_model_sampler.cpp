// Sampler: greedy ties, truncation by top-k and top-p, seeded determinism, and the sampled
// frequencies against the softmax they should follow.
#include <gtest/gtest.h>

#include <cmath>

#include "twell/error.h"
#include "twell/model.h"

namespace twell {
namespace {

TEST(Sampler, GreedyTakesTheLowestIdOfTheMaxima) {
  const std::vector<float> logits = {0.5f, 2.0f, -1.0f, 2.0f};
  Sampler greedy(SamplerConfig{});
  EXPECT_EQ(greedy.sample(logits.data(), 4), 1);
  // top_k = 1 at any temperature is greedy too.
  Sampler top1(SamplerConfig{1.5f, 1, 1.0f, 9});
  for (int i = 0; i < 20; ++i) EXPECT_EQ(top1.sample(logits.data(), 4), 1);
}

TEST(Sampler, FrequenciesFollowTheSoftmax) {
  const std::vector<double> probabilities = {0.5, 0.3, 0.15, 0.05};
  std::vector<float> logits;
  for (double p : probabilities) logits.push_back(static_cast<float>(std::log(p)) + 3.0f);  // shift-invariant
  const int draws = 40000;
  auto frequencies = [&](SamplerConfig config) {
    Sampler sampler(config);
    std::vector<double> counts(4, 0);
    for (int i = 0; i < draws; ++i) counts[sampler.sample(logits.data(), 4)] += 1.0 / draws;
    return counts;
  };
  // Plain temperature 1: the probabilities themselves (4 sigma of a binomial at 40000 draws < 0.01).
  std::vector<double> plain = frequencies({1.0f, 0, 1.0f, 1});
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(plain[i], probabilities[i], 0.01) << i;
  // top_k = 2: renormalized over the two largest.
  std::vector<double> top2 = frequencies({1.0f, 2, 1.0f, 2});
  EXPECT_NEAR(top2[0], 0.5 / 0.8, 0.01);
  EXPECT_NEAR(top2[1], 0.3 / 0.8, 0.01);
  EXPECT_EQ(top2[2] + top2[3], 0.0);
  // top_p = 0.9: the smallest prefix reaching 0.9 is {0, 1, 2} (0.95).
  std::vector<double> nucleus = frequencies({1.0f, 0, 0.9f, 3});
  EXPECT_NEAR(nucleus[0], 0.5 / 0.95, 0.01);
  EXPECT_NEAR(nucleus[2], 0.15 / 0.95, 0.01);
  EXPECT_EQ(nucleus[3], 0.0);
  // Temperature 0.5 squares the probabilities before renormalizing.
  std::vector<double> sharp = frequencies({0.5f, 0, 1.0f, 4});
  double total = 0;
  for (double p : probabilities) total += p * p;
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(sharp[i], probabilities[i] * probabilities[i] / total, 0.01) << i;
}

TEST(Sampler, SeedDecidesTheSequence) {
  std::vector<float> logits(50);
  for (int i = 0; i < 50; ++i) logits[i] = std::sin(0.7f * i);
  auto run = [&](uint64_t seed) {
    Sampler sampler(SamplerConfig{1.0f, 0, 1.0f, seed});
    std::vector<int32_t> tokens;
    for (int i = 0; i < 64; ++i) tokens.push_back(sampler.sample(logits.data(), 50));
    return tokens;
  };
  EXPECT_EQ(run(5), run(5));
  EXPECT_NE(run(5), run(6));
}

TEST(Sampler, RefusesBadSettings) {
  EXPECT_THROW(Sampler(SamplerConfig{-1.0f, 0, 1.0f, 0}), Error);
  EXPECT_THROW(Sampler(SamplerConfig{1.0f, -2, 1.0f, 0}), Error);
  EXPECT_THROW(Sampler(SamplerConfig{1.0f, 0, 0.0f, 0}), Error);
  EXPECT_THROW(Sampler(SamplerConfig{1.0f, 0, 1.5f, 0}), Error);
  Sampler sampler(SamplerConfig{});
  EXPECT_THROW(sampler.sample(nullptr, 0), Error);
}

}  // namespace
}  // namespace twell
