// CUDA implementation of yatt::copy_blocks_cuda (see copy_blocks.h): one launch for a whole
// plan. The plan's concatenated byte space is cut into 64 KiB chunks, one thread block each; a
// block finds its first plan block by binary search over the byte offsets, then copies its chunk
// with 16-byte vector loads where source, destination, strides and row length allow it (all
// resharding blocks of fp32 / bf16 weights with 8-element-aligned widths do), else byte by byte.
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "copy_blocks.h"

namespace yatt {

namespace {

constexpr int64_t kChunk = 64 * 1024;
constexpr int kThreads = 256;

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw std::runtime_error(std::string("copy_blocks_cuda: ") + what + ": " + cudaGetErrorString(err));
}

__device__ void copy_part(const int64_t* f, int64_t begin, int64_t end) {
  const char* src = reinterpret_cast<const char*>(f[0]);
  char* dst = reinterpret_cast<char*>(f[2]);
  const int64_t ss = f[1], ds = f[3], rows = f[4], w = f[5];
  const bool flat = rows == 1 || (ss == w && ds == w);
  const bool vec = ((reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst) | w |
                     (flat ? 0 : (ss | ds)) | begin | end) & 15) == 0;
  if (vec) {
    for (int64_t i = begin + 16 * threadIdx.x; i < end; i += 16 * blockDim.x) {
      const int64_t row = flat ? 0 : i / w, col = flat ? i : i % w;
      *reinterpret_cast<uint4*>(dst + row * ds + col) = *reinterpret_cast<const uint4*>(src + row * ss + col);
    }
  } else {
    for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
      const int64_t row = flat ? 0 : i / w, col = flat ? i : i % w;
      dst[row * ds + col] = src[row * ss + col];
    }
  }
}

__global__ void copy_blocks_kernel(const int64_t* blocks, const int64_t* offsets, int64_t n, int64_t total) {
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * kChunk;
  const int64_t end = min(begin + kChunk, total);
  int64_t lo = 0, hi = n - 1;  // last plan block whose offset <= begin
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (offsets[mid] <= begin) lo = mid; else hi = mid - 1;
  }
  for (int64_t b = lo, pos = begin; pos < end && b < n; ++b) {
    const int64_t* f = blocks + b * kBlockFields;
    const int64_t first = offsets[b], last = first + f[4] * f[5];
    const int64_t stop = min(end, last);
    if (stop > pos) copy_part(f, pos - first, stop - first);
    pos = max(pos, stop);
  }
}

}  // namespace

void copy_blocks_cuda(const int64_t* blocks, int64_t n, std::uintptr_t stream_handle) {
  if (n <= 0) return;
  const int64_t total = plan_bytes(blocks, n);
  if (total == 0) return;
  std::vector<int64_t> host(static_cast<size_t>(n) * (kBlockFields + 1));
  std::copy(blocks, blocks + n * kBlockFields, host.begin());
  for (int64_t b = 0, off = 0; b < n; ++b) {
    host[n * kBlockFields + b] = off;
    off += blocks[b * kBlockFields + 4] * blocks[b * kBlockFields + 5];
  }
  auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
  int64_t* dev = nullptr;
  const size_t bytes = host.size() * sizeof(int64_t);
  check(cudaMallocAsync(reinterpret_cast<void**>(&dev), bytes, stream), "cudaMallocAsync");
  check(cudaMemcpyAsync(dev, host.data(), bytes, cudaMemcpyHostToDevice, stream), "cudaMemcpyAsync");
  const int64_t grid = (total + kChunk - 1) / kChunk;
  copy_blocks_kernel<<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(dev, dev + n * kBlockFields, n, total);
  check(cudaGetLastError(), "launch");
  check(cudaFreeAsync(dev, stream), "cudaFreeAsync");
  check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
}

}  // namespace yatt
