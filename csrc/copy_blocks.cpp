#include "copy_blocks.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define YATT_AVX2_STREAM 1
#endif

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

// A plan of at least this many bytes is written with non-temporal stores: its destination is far
// larger than the caches, so a regular store's read-for-ownership of each destination line is
// wasted traffic. glibc's memcpy streams only runs above its own threshold (megabytes), not the
// rows of a TP merge or split, nor a head group's or a shard's run of a few hundred KiB. Smaller
// plans keep regular stores: their destinations stay in cache for whoever reads them next.
constexpr int64_t kStreamPlanBytes = int64_t{64} << 20;
constexpr int64_t kStreamRowBytes = 256;  // shorter runs: memcpy (head/tail handling costs more)

#if defined(YATT_AVX2_STREAM)
// memcpy with 32-byte loads and non-temporal 32-byte stores (AVX2 CPUs; chosen at run time).
__attribute__((target("avx2"))) void stream_copy_avx2(char* dst, const char* src, int64_t n) {
  const int64_t head = std::min<int64_t>(n, (32 - (reinterpret_cast<uintptr_t>(dst) & 31)) & 31);
  std::memcpy(dst, src, static_cast<size_t>(head));
  int64_t i = head;
  for (; i + 128 <= n; i += 128) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 32));
    const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 64));
    const __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 96));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 32), b);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 64), c);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 96), d);
  }
  for (; i + 32 <= n; i += 32)
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
  std::memcpy(dst + i, src + i, static_cast<size_t>(n - i));
}
bool has_avx2() {
  static const bool has = (__builtin_cpu_init(), __builtin_cpu_supports("avx2"));
  return has;
}
#endif

// One run of n bytes: in a streamed plan, a run of >= kStreamRowBytes on an AVX2 CPU goes through
// non-temporal stores; everything else is memcpy (the caches' read for ownership stays). The
// caller fences (copy_span) before streamed stores count as done.
void copy_run(char* dst, const char* src, int64_t n, bool stream) {
#if defined(YATT_AVX2_STREAM)
  if (stream && n >= kStreamRowBytes && has_avx2()) return stream_copy_avx2(dst, src, n);
#endif
  std::memcpy(dst, src, static_cast<size_t>(n));
}

// Copy bytes [begin, end) of block `blk`'s own byte space (row-major over its rows).
void copy_range(const Block& blk, int64_t begin, int64_t end, bool stream) {
  const int64_t w = blk.row_bytes;
  if (blk.rows == 1 || (blk.src_stride == w && blk.dst_stride == w)) {  // one contiguous run
    copy_run(blk.dst + begin, blk.src + begin, end - begin, stream);
    return;
  }
  while (begin < end) {
    const int64_t row = begin / w, col = begin % w;
    const int64_t take = std::min(w - col, end - begin);
    copy_run(blk.dst + row * blk.dst_stride + col, blk.src + row * blk.src_stride + col, take, stream);
    begin += take;
  }
}

// Copy bytes [begin, end) of the concatenated plan; `offsets[b]` = first byte of block b.
void copy_span(const int64_t* blocks, const std::vector<int64_t>& offsets, int64_t begin, int64_t end,
               bool stream) {
  auto it = std::upper_bound(offsets.begin(), offsets.end(), begin);
  for (int64_t b = (it - offsets.begin()) - 1; begin < end; ++b) {
    const Block blk = block_at(blocks, b);
    const int64_t first = offsets[b], last = first + blk.rows * blk.row_bytes;
    const int64_t stop = std::min(end, last);
    if (stop > begin) copy_range(blk, begin - first, stop - first, stream);
    begin = std::max(begin, stop);
  }
#if defined(YATT_AVX2_STREAM)
  if (stream) _mm_sfence();  // this thread's streamed stores are visible before it is joined
#endif
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
  const bool stream = total >= kStreamPlanBytes;
  std::vector<std::thread> pool;
  pool.reserve(threads - 1);
  for (int t = 1; t < threads; ++t)
    pool.emplace_back(copy_span, blocks, std::cref(offsets), cut(t), cut(t + 1), stream);
  copy_span(blocks, offsets, 0, cut(1), stream);
  for (auto& th : pool) th.join();
}

}  // namespace yatt
