// Sequence partitioning: split n items with integer costs into k parts of near-equal total cost.
//
// Shared contract of every function here:
//   * costs are int64 >= 0 and their sum must fit in int64, else std::invalid_argument
//     (pybind11 turns it into ValueError); k >= 1, else std::invalid_argument.
//   * the result holds exactly k parts (split_micro_batches: as many as it needs); every index
//     in [0, n) appears exactly once; indices ascend inside a part; parts are ordered by their
//     smallest index, empty parts last. Parts are empty only when n < k.
//   * deterministic: ties are broken by index / creation order, never by address or hash.
#pragma once

#include <cstdint>
#include <vector>

namespace yatt {

using Parts = std::vector<std::vector<int64_t>>;

// Karmarkar-Karp largest differencing method, k-way (Karmarkar & Karp 1982, "The differencing
// method of set partitioning"; multi-way form as in verl's seqlen_balancing).
// Each item starts as a state of k subsets (itself + k-1 empty ones); the two states with the
// largest spread (max - min subset sum) are repeatedly merged, pairing the i-th largest subset of
// one with the i-th smallest of the other, until one state is left.
// Priority: larger spread first, then larger top subset, then older state (creation order;
// initial states are created in ascending (cost, index) order).
// equal_size: items are grouped k at a time in ascending (cost, index) order, so every part gets
// n / k items; requires n % k == 0, otherwise this falls back to greedy_partition(..., true).
// Cost: O(n log n + n * k log k) time worst case, O(n + k) memory.
Parts karmarkar_karp(const std::vector<int64_t>& costs, int64_t k, bool equal_size);

// Greedy longest-processing-time (LPT, Graham 1969): items in descending (cost, then ascending
// index) order, each into the part with the smallest (sum, item count, part id).
// equal_size: part sizes are capped so they differ by at most one (n / k or n / k + 1 items;
// exactly n / k when n % k == 0). O(n log n + n log k).
Parts greedy_partition(const std::vector<int64_t>& costs, int64_t k, bool equal_size);

// Split sequences of `lengths` tokens into micro-batches of at most max_tokens tokens each.
// A sequence longer than max_tokens gets a micro-batch of its own. The others are split with
// karmarkar_karp into m parts, m the smallest count whose KK split fits the budget: candidates are
// tried upward from the lower bound max(ceil(sum / max_tokens), #items > max_tokens / 2) for a few
// steps, then by doubling and bisection (exact whenever feasibility is monotone in m, which it is
// in practice; m = #items always fits). Micro-batches are ordered by their smallest index.
// max_tokens >= 1, else std::invalid_argument.
Parts split_micro_batches(const std::vector<int64_t>& lengths, int64_t max_tokens);

}  // namespace yatt
