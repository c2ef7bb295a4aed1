#include "partition.h"

#include <algorithm>
#include <functional>
#include <limits>
#include <numeric>
#include <queue>
#include <stdexcept>
#include <string>
#include <tuple>

namespace yatt {
namespace {

// Validates costs (>= 0, sum fits in int64) and returns their sum.
int64_t checked_total(const std::vector<int64_t>& costs, const char* what) {
  int64_t total = 0;
  for (size_t i = 0; i < costs.size(); ++i) {
    if (costs[i] < 0)
      throw std::invalid_argument(std::string(what) + " must be non-negative, got " + what + "[" +
                                  std::to_string(i) + "] = " + std::to_string(costs[i]));
    if (costs[i] > std::numeric_limits<int64_t>::max() - total)
      throw std::invalid_argument(std::string("sum of ") + what + " overflows int64");
    total += costs[i];
  }
  return total;
}

void check_k(int64_t k) {
  if (k < 1) throw std::invalid_argument("k must be >= 1, got " + std::to_string(k));
}

// Indices sorted by (cost, index), ascending or descending in cost.
std::vector<int64_t> order_by_cost(const std::vector<int64_t>& costs, bool descending) {
  std::vector<int64_t> order(costs.size());
  std::iota(order.begin(), order.end(), int64_t{0});
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return descending ? costs[a] > costs[b] : costs[a] < costs[b];
  });
  return order;
}

// The documented output order: indices ascending in a part, parts by smallest index, empties
// last, padded to k parts.
Parts canonical(Parts parts, int64_t k) {
  for (auto& p : parts) std::sort(p.begin(), p.end());
  std::stable_sort(parts.begin(), parts.end(), [](const auto& a, const auto& b) {
    if (a.empty() || b.empty()) return !a.empty() && b.empty();
    return a.front() < b.front();
  });
  parts.resize(static_cast<size_t>(k));
  return parts;
}

// ---- Karmarkar-Karp ------------------------------------------------------------------------
// A subset is a singly linked list of item indices through next[] (O(1) concatenation).
struct Subset {
  int64_t sum = 0;
  int64_t head = -1, tail = -1;
};

// A state stores only its non-empty subsets, sorted by sum descending; the remaining
// k - sets.size() subsets are implicitly empty (sum 0). This keeps the n initial one-item
// states O(1) each instead of O(k).
struct State {
  std::vector<Subset> sets;
};

struct HeapEntry {
  int64_t spread, top, seq, slot;
};
// std::priority_queue pops the maximum: largest spread, then largest top, then smallest seq.
struct PopsLater {
  bool operator()(const HeapEntry& a, const HeapEntry& b) const {
    if (a.spread != b.spread) return a.spread < b.spread;
    if (a.top != b.top) return a.top < b.top;
    return a.seq > b.seq;
  }
};

void sort_desc(std::vector<Subset>& sets) {
  std::stable_sort(sets.begin(), sets.end(),
                   [](const Subset& a, const Subset& b) { return a.sum > b.sum; });
}

Subset concat(Subset a, const Subset& b, std::vector<int64_t>& next) {
  if (b.head < 0) return a;
  if (a.head < 0) return b;
  next[a.tail] = b.head;
  a.tail = b.tail;
  a.sum += b.sum;
  return a;
}

// Merge b into a: result subset i = a's i-th largest + b's i-th smallest (= b[k-1-i]).
// Only slots where one side is non-empty are materialised: i < |a| or k-1-i < |b|.
void merge_into(State& a, State& b, int64_t k, std::vector<int64_t>& next) {
  const int64_t na = static_cast<int64_t>(a.sets.size());
  const int64_t nb = static_cast<int64_t>(b.sets.size());
  std::vector<Subset> out;
  out.reserve(static_cast<size_t>(std::min(k, na + nb)));
  auto emit = [&](int64_t i) {
    Subset s = i < na ? a.sets[i] : Subset{};
    const int64_t j = k - 1 - i;
    if (j < nb) s = concat(s, b.sets[j], next);
    out.push_back(s);
  };
  for (int64_t i = 0; i < na; ++i) emit(i);
  for (int64_t i = std::max(na, k - nb); i < k; ++i) emit(i);
  sort_desc(out);
  a.sets = std::move(out);
  std::vector<Subset>().swap(b.sets);
}

}  // namespace

Parts karmarkar_karp(const std::vector<int64_t>& costs, int64_t k, bool equal_size) {
  check_k(k);
  checked_total(costs, "costs");
  const int64_t n = static_cast<int64_t>(costs.size());
  if (equal_size && n % k != 0) return greedy_partition(costs, k, true);
  if (n == 0) return Parts(static_cast<size_t>(k));

  const std::vector<int64_t> order = order_by_cost(costs, /*descending=*/false);
  const int64_t group = equal_size ? k : 1;
  std::vector<int64_t> next(static_cast<size_t>(n), -1);
  std::vector<State> states;
  states.reserve(static_cast<size_t>(n / group));
  std::priority_queue<HeapEntry, std::vector<HeapEntry>, PopsLater> heap;
  auto push = [&](int64_t slot, int64_t seq) {
    const auto& sets = states[slot].sets;  // never empty: every state holds >= 1 item
    const int64_t top = sets.front().sum;
    const int64_t bottom = static_cast<int64_t>(sets.size()) < k ? 0 : sets.back().sum;
    heap.push({top - bottom, top, seq, slot});
  };

  for (int64_t g = 0; g < n; g += group) {
    State st;
    st.sets.reserve(static_cast<size_t>(group));
    for (int64_t j = g; j < g + group; ++j) {
      const int64_t idx = order[j];
      st.sets.push_back({costs[idx], idx, idx});
    }
    sort_desc(st.sets);
    states.push_back(std::move(st));
    const int64_t slot = static_cast<int64_t>(states.size()) - 1;
    push(slot, slot);
  }

  int64_t seq = static_cast<int64_t>(states.size());
  while (heap.size() > 1) {
    const HeapEntry a = heap.top();
    heap.pop();
    const HeapEntry b = heap.top();
    heap.pop();
    merge_into(states[a.slot], states[b.slot], k, next);
    push(a.slot, seq++);
  }

  Parts parts;
  for (const Subset& s : states[heap.top().slot].sets) {
    std::vector<int64_t> p;
    for (int64_t i = s.head; i >= 0; i = next[i]) p.push_back(i);
    parts.push_back(std::move(p));
  }
  return canonical(std::move(parts), k);
}

Parts greedy_partition(const std::vector<int64_t>& costs, int64_t k, bool equal_size) {
  check_k(k);
  checked_total(costs, "costs");
  const int64_t n = static_cast<int64_t>(costs.size());
  Parts parts(static_cast<size_t>(k));
  // equal_size caps: every part holds n / k items, n % k of them one more.
  const int64_t base = n / k;
  int64_t extra = n % k;

  // Min-heap of (sum, item count, part id). Empty parts win every tie, in id order, so only the
  // first min(n, k) parts can ever receive items.
  using Key = std::tuple<int64_t, int64_t, int64_t>;
  std::priority_queue<Key, std::vector<Key>, std::greater<Key>> heap;
  for (int64_t p = 0; p < std::min(n, k); ++p) heap.emplace(0, 0, p);

  for (const int64_t idx : order_by_cost(costs, /*descending=*/true)) {
    for (;;) {
      const auto [sum, count, p] = heap.top();
      heap.pop();
      if (equal_size && (count > base || (count == base && extra == 0)))
        continue;  // full for good: counts only grow, `extra` only shrinks
      if (equal_size && count == base) --extra;
      parts[p].push_back(idx);
      heap.emplace(sum + costs[idx], count + 1, p);
      break;
    }
  }
  return canonical(std::move(parts), k);
}

Parts split_micro_batches(const std::vector<int64_t>& lengths, int64_t max_tokens) {
  if (max_tokens < 1)
    throw std::invalid_argument("max_tokens must be >= 1, got " + std::to_string(max_tokens));
  checked_total(lengths, "lengths");

  Parts batches;
  std::vector<int64_t> rest_idx, rest_len;
  for (int64_t i = 0; i < static_cast<int64_t>(lengths.size()); ++i) {
    if (lengths[i] > max_tokens) {
      batches.push_back({i});
    } else {
      rest_idx.push_back(i);
      rest_len.push_back(lengths[i]);
    }
  }

  if (!rest_len.empty()) {
    const int64_t nr = static_cast<int64_t>(rest_len.size());
    const int64_t total = std::accumulate(rest_len.begin(), rest_len.end(), int64_t{0});
    // Items above max_tokens / 2 cannot share a micro-batch.
    const int64_t halves = std::count_if(rest_len.begin(), rest_len.end(),
                                         [&](int64_t x) { return x > max_tokens / 2; });
    const int64_t lower = std::max<int64_t>(
        {total / max_tokens + (total % max_tokens != 0), halves, int64_t{1}});

    Parts best;
    auto fits = [&](int64_t m) {
      Parts p = karmarkar_karp(rest_len, m, false);
      for (const auto& part : p) {
        int64_t s = 0;
        for (const int64_t j : part) s += rest_len[j];
        if (s > max_tokens) return false;
      }
      best = std::move(p);
      return true;
    };

    // Invariant: `fail` < answer <= `hi`. m = nr (one sequence each) always fits.
    constexpr int64_t kLinearSteps = 4;
    int64_t fail = lower - 1, hi = -1;
    for (int64_t m = lower; m <= nr && m < lower + kLinearSteps; ++m) {
      if (fits(m)) {
        hi = m;
        break;
      }
      fail = m;
    }
    if (hi < 0) {
      for (int64_t step = 1;; step *= 2) {
        hi = std::min(nr, fail + step);
        if (fits(hi)) break;
        fail = hi;
      }
      // `best` always holds the split for the current `hi` (the last feasible one tried).
      while (hi - fail > 1) {
        const int64_t mid = fail + (hi - fail) / 2;
        if (fits(mid)) hi = mid;
        else fail = mid;
      }
    }
    for (const auto& part : best) {
      if (part.empty()) continue;
      std::vector<int64_t> b;
      b.reserve(part.size());
      for (const int64_t j : part) b.push_back(rest_idx[j]);
      batches.push_back(std::move(b));
    }
  }
  const int64_t m = static_cast<int64_t>(batches.size());
  return canonical(std::move(batches), m);
}

}  // namespace yatt
