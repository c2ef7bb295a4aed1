#include "dp_balance.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <exception>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>

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

  // Micro-batches of each rank, ranks split over threads (independent, so the plan is the same
  // for any thread count).
  std::vector<Parts> batches(parts.size());
  std::atomic<size_t> next_rank{0};
  std::exception_ptr error;
  std::mutex error_mutex;
  auto work = [&] {
    for (size_t r = next_rank++; r < parts.size(); r = next_rank++) {
      try {
        std::vector<int64_t> part_lengths;
        part_lengths.reserve(parts[r].size());
        for (const int64_t i : parts[r]) part_lengths.push_back(lengths[i]);
        batches[r] = split_micro_batches(part_lengths, max_tokens);
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mutex);
        if (!error) error = std::current_exception();
      }
    }
  };
  const size_t threads = std::min<size_t>(parts.size(), std::max(1u, std::thread::hardware_concurrency()));
  std::vector<std::thread> pool;
  for (size_t t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (auto& th : pool) th.join();
  if (error) std::rethrow_exception(error);

  DpPlan plan;
  plan.order.reserve(static_cast<size_t>(n));
  plan.rank_offsets.push_back(0);
  plan.mb_offsets.push_back(0);
  plan.mb_rank_offsets.push_back(0);
  for (size_t r = 0; r < parts.size(); ++r) {
    int64_t cost = 0;
    for (const int64_t i : parts[r]) cost += costs[i];
    plan.rank_cost.push_back(cost);
    for (const auto& mb : batches[r]) {
      if (mb.empty()) continue;
      for (const int64_t j : mb) plan.order.push_back(parts[r][j]);
      plan.mb_offsets.push_back(static_cast<int64_t>(plan.order.size()));
    }
    plan.rank_offsets.push_back(static_cast<int64_t>(plan.order.size()));
    plan.mb_rank_offsets.push_back(static_cast<int64_t>(plan.mb_offsets.size()) - 1);
  }
  plan.costs = std::move(costs);
  return plan;
}

}  // namespace yatt
