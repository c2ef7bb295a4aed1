#include "dp_balance.h"

#include <cmath>
#include <stdexcept>
#include <string>

#include "partition.h"

namespace yatt {

DpPlan dp_balance(const std::vector<int64_t>& lengths, int64_t ranks, int64_t max_tokens,
                  double cost_linear, double cost_quadratic, bool equal_count) {
  if (ranks < 1) throw std::invalid_argument("ranks must be >= 1, got " + std::to_string(ranks));
  if (max_tokens < 1) throw std::invalid_argument("max_tokens must be >= 1, got " + std::to_string(max_tokens));
  if (!(cost_linear >= 0) || !(cost_quadratic >= 0))
    throw std::invalid_argument("cost coefficients must be finite and >= 0");
  const int64_t n = static_cast<int64_t>(lengths.size());
  std::vector<int64_t> costs(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    if (lengths[i] < 0) throw std::invalid_argument("lengths must be >= 0, got " + std::to_string(lengths[i]));
    const double L = static_cast<double>(lengths[i]);
    const double c = std::round(cost_linear * L + cost_quadratic * L * L);
    if (!(c < 9.2e18)) throw std::invalid_argument("sequence cost overflows int64");
    costs[i] = static_cast<int64_t>(c);
  }
  const Parts parts = karmarkar_karp(costs, ranks, equal_count);  // validates the cost sum

  DpPlan plan;
  plan.order.reserve(static_cast<size_t>(n));
  plan.rank_offsets.push_back(0);
  plan.mb_offsets.push_back(0);
  plan.mb_rank_offsets.push_back(0);
  for (const auto& part : parts) {
    std::vector<int64_t> part_lengths;
    part_lengths.reserve(part.size());
    int64_t cost = 0;
    for (const int64_t i : part) {
      part_lengths.push_back(lengths[i]);
      cost += costs[i];
    }
    plan.rank_cost.push_back(cost);
    for (const auto& mb : split_micro_batches(part_lengths, max_tokens)) {
      if (mb.empty()) continue;
      for (const int64_t j : mb) plan.order.push_back(part[j]);
      plan.mb_offsets.push_back(static_cast<int64_t>(plan.order.size()));
    }
    plan.rank_offsets.push_back(static_cast<int64_t>(plan.order.size()));
    plan.mb_rank_offsets.push_back(static_cast<int64_t>(plan.mb_offsets.size()) - 1);
  }
  return plan;
}

}  // namespace yatt
