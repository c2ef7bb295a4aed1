#include "copy_blocks.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace yatt {

namespace {

struct Block {
  const char* src;
  int64_t src_stride;
  char* dst;
  int64_t dst_stride;
  int64_t rows;
  int64_t row_bytes;
};

Block block_at(const int64_t* blocks, int64_t b) {
  const int64_t* f = blocks + b * kBlockFields;
  return {reinterpret_cast<const char*>(f[0]), f[1], reinterpret_cast<char*>(f[2]), f[3], f[4], f[5]};
}

// Copy bytes [begin, end) of block `blk`'s own byte space (row-major over its rows).
void copy_range(const Block& blk, int64_t begin, int64_t end) {
  const int64_t w = blk.row_bytes;
  if (blk.rows == 1 || (blk.src_stride == w && blk.dst_stride == w)) {  // one contiguous run
    std::memcpy(blk.dst + begin, blk.src + begin, static_cast<size_t>(end - begin));
    return;
  }
  while (begin < end) {
    const int64_t row = begin / w, col = begin % w;
    const int64_t take = std::min(w - col, end - begin);
    std::memcpy(blk.dst + row * blk.dst_stride + col, blk.src + row * blk.src_stride + col,
                static_cast<size_t>(take));
    begin += take;
  }
}

// Copy bytes [begin, end) of the concatenated plan; `offsets[b]` = first byte of block b.
void copy_span(const int64_t* blocks, const std::vector<int64_t>& offsets, int64_t begin, int64_t end) {
  auto it = std::upper_bound(offsets.begin(), offsets.end(), begin);
  for (int64_t b = (it - offsets.begin()) - 1; begin < end; ++b) {
    const Block blk = block_at(blocks, b);
    const int64_t first = offsets[b], last = first + blk.rows * blk.row_bytes;
    const int64_t stop = std::min(end, last);
    if (stop > begin) copy_range(blk, begin - first, stop - first);
    begin = std::max(begin, stop);
  }
}

}  // namespace

int64_t plan_bytes(const int64_t* blocks, int64_t n) {
  int64_t total = 0;
  for (int64_t b = 0; b < n; ++b) {
    const Block blk = block_at(blocks, b);
    if (blk.rows < 0 || blk.row_bytes < 0 || blk.src_stride < 0 || blk.dst_stride < 0)
      throw std::invalid_argument("copy plan block " + std::to_string(b) + " has a negative field");
    if (blk.rows > 1 && (blk.src_stride < blk.row_bytes || blk.dst_stride < blk.row_bytes))
      throw std::invalid_argument("copy plan block " + std::to_string(b) + ": row_bytes exceeds its stride");
    total += blk.rows * blk.row_bytes;
  }
  return total;
}

void copy_blocks_cpu(const int64_t* blocks, int64_t n, int threads) {
  std::vector<int64_t> offsets(static_cast<size_t>(n));
  int64_t total = 0;
  for (int64_t b = 0; b < n; ++b) {
    offsets[b] = total;
    total += blocks[b * kBlockFields + 4] * blocks[b * kBlockFields + 5];
  }
  if (total == 0) return;
  if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  constexpr int64_t kMinPerThread = int64_t{1} << 20;
  threads = static_cast<int>(std::clamp<int64_t>(total / kMinPerThread, 1, threads));
  // Thread t takes bytes [t*total/threads, (t+1)*total/threads), rounded to 64-byte lines.
  auto cut = [&](int t) { return t == threads ? total : (total * t / threads) & ~int64_t{63}; };
  std::vector<std::thread> pool;
  pool.reserve(threads - 1);
  for (int t = 1; t < threads; ++t)
    pool.emplace_back(copy_span, blocks, std::cref(offsets), cut(t), cut(t + 1));
  copy_span(blocks, offsets, 0, cut(1));
  for (auto& th : pool) th.join();
}

}  // namespace yatt
