// Fused data-parallel balancer: one call from sequence lengths to the full layout of a step.
//
// Given the lengths of all sequences of a step (every DP rank's, concatenated) it returns the
// partition across DP ranks (Karmarkar-Karp on a cost model), the micro-batches inside each rank
// under a token budget (split_micro_batches), and the arrays to pack samples into that layout and
// unpack results back to the original order. Deterministic: every rank computes the same plan
// from the same lengths, so the plan itself never travels.
#pragma once

#include <cstdint>
#include <vector>

namespace yatt {

struct DpPlan {
  // Sample indices in packed order: grouped by rank, then by micro-batch, ascending inside one.
  std::vector<int64_t> order;
  // ranks + 1 entries: rank r holds order[rank_offsets[r] : rank_offsets[r + 1]].
  std::vector<int64_t> rank_offsets;
  // M + 1 entries over all M micro-batches: micro-batch b is order[mb_offsets[b] : mb_offsets[b + 1]].
  std::vector<int64_t> mb_offsets;
  // ranks + 1 entries: rank r's micro-batches are b in [mb_rank_offsets[r], mb_rank_offsets[r + 1]).
  std::vector<int64_t> mb_rank_offsets;
  // ranks entries: cost sum per rank under the cost model.
  std::vector<int64_t> rank_cost;
  // n entries: cost of each sequence under the cost model (rank_cost sums these).
  std::vector<int64_t> costs;
};

// lengths: tokens per sequence (>= 0). ranks >= 1. max_tokens >= 1: micro-batch token budget (a
// longer sequence gets a micro-batch of its own). Cost of a sequence of L tokens:
// round(cost_linear * L + cost_quadratic * L^2) (>= 0; default tokens: 1, 0; attention FLOPs grow
// with L^2). equal_count: every rank gets n / ranks sequences when ranks divides n (for fixed
// micro-batch shapes), otherwise counts differ by at most one.
// The per-rank micro-batch splits run on std::thread::hardware_concurrency() threads; the plan
// does not depend on the thread count.
// Throws std::invalid_argument on a negative length or cost coefficient, ranks < 1, max_tokens < 1,
// or a cost sum overflowing int64.
DpPlan dp_balance(const std::vector<int64_t>& lengths, int64_t ranks, int64_t max_tokens,
                  double cost_linear, double cost_quadratic, bool equal_count);

}  // namespace yatt
