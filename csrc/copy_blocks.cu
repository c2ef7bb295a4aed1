// CUDA implementation of yatt::copy_tasks_cuda (see copy_blocks.h): one stream-ordered launch of
// a resident task table. One thread block of kThreads threads per task (a table of more than
// 2^31-1 tasks takes several launches: no grid-stride loop, which costs registers); every thread
// moves kUnroll elements of the task per round, loading all of them before storing any (kUnroll
// loads in flight), so a 32 KiB task of 16-byte elements is one round. Measured on an H200 with
// 1 GB copies (bench/reshard_gpu.py): 8 in flight and 32 KiB tasks reached 0.98 of a
// device-to-device copy for one flat run and 0.94-0.95 for the resharding plans; 4 in flight
// and 64 KiB tasks 0.94 and 0.91-0.92 (smaller tasks shorten the tail of each launch). The
// element is the widest of 16/8/4/2/1 bytes that the task's addresses (and, for several rows, its
// strides and row length) are aligned to: 16 bytes for every bf16 / fp32 block whose offsets and
// widths are multiples of 8 elements. A one-row task is a plain vector copy plus a byte tail; a
// multi-row task finds an element's row and column with one 32-bit division.
// The per-task code is __host__ __device__ so that a host program can emulate the kernel thread
// by thread (tests/test_reshard_tasks.py does, to check the index arithmetic without a GPU).
#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "copy_blocks.h"

namespace yatt {

namespace cuda_copy {

constexpr uint32_t kThreads = 256;
constexpr uint32_t kUnroll = 8;  // 64 registers on sm_90, no spills

struct SlotBases {  // by-value kernel parameter: 2 KiB (the limit is 4 KiB)
  uint64_t ptr[kMaxSlotArgs];
};
static_assert(sizeof(SlotBases) + 2 * sizeof(int64_t*) <= 4096, "kernel parameters over 4 KiB");

// Global loads through the read-only path, stores write-back (plain dereferences on the host,
// where tests emulate the kernel): the pointers come from integers, so without these the
// compiler emits generic loads and stores.
template <typename V>
__host__ __device__ __forceinline__ V load(const V* p) {
#ifdef __CUDA_ARCH__
  return __ldg(p);
#else
  return *p;
#endif
}
template <typename V>
__host__ __device__ __forceinline__ void store(V* p, const V& v) {
#ifdef __CUDA_ARCH__
  __stwb(p, v);
#else
  *p = v;
#endif
}

// Elements [0, w / sizeof(V)) of one run of w bytes, then its w % sizeof(V) tail bytes.
template <typename V>
__host__ __device__ void copy_flat(const char* __restrict__ src, char* __restrict__ dst, uint32_t w, uint32_t tid) {
  const V* s = reinterpret_cast<const V*>(src);
  V* d = reinterpret_cast<V*>(dst);
  const uint32_t n = w / sizeof(V);
  for (uint32_t base = tid; base < n; base += kUnroll * kThreads) {  // base < n < 2^31: no wrap
    V v[kUnroll];
#pragma unroll
    for (uint32_t k = 0; k < kUnroll; ++k)
      if (base + k * kThreads < n) v[k] = load(s + base + k * kThreads);
#pragma unroll
    for (uint32_t k = 0; k < kUnroll; ++k)
      if (base + k * kThreads < n) store(d + base + k * kThreads, v[k]);
  }
  const uint32_t tail = w - n * sizeof(V);  // < sizeof(V) <= kThreads
  if (tid < tail) store(dst + n * sizeof(V) + tid, load(src + n * sizeof(V) + tid));
}

// `rows` rows of w bytes (w a multiple of sizeof(V)); row r at src + r*ss, dst + r*ds.
template <typename V>
__host__ __device__ void copy_rows(const char* __restrict__ src, char* __restrict__ dst, int64_t ss, int64_t ds,
                                   uint32_t rows, uint32_t w, uint32_t tid) {
  const uint32_t wu = w / sizeof(V), n = rows * wu;  // n = rows*w/sizeof(V) < 2^31
  for (uint32_t base = tid; base < n; base += kUnroll * kThreads) {
    V v[kUnroll];
    uint32_t row[kUnroll], col[kUnroll];
#pragma unroll
    for (uint32_t k = 0; k < kUnroll; ++k) {
      const uint32_t i = base + k * kThreads;
      row[k] = i / wu;
      col[k] = i - row[k] * wu;
      if (i < n) v[k] = load(reinterpret_cast<const V*>(src + row[k] * ss + int64_t{col[k]} * sizeof(V)));
    }
#pragma unroll
    for (uint32_t k = 0; k < kUnroll; ++k)
      if (base + k * kThreads < n) store(reinterpret_cast<V*>(dst + row[k] * ds + int64_t{col[k]} * sizeof(V)), v[k]);
  }
}

// Thread `tid` of one task's thread block: rows of w bytes from absolute address src to dst.
__host__ __device__ inline void copy_task(uint64_t src, int64_t ss, uint64_t dst, int64_t ds, uint32_t rows,
                                          uint32_t w, uint32_t tid) {
  const char* s = reinterpret_cast<const char*>(src);
  char* d = reinterpret_cast<char*>(dst);
  if (rows == 1) {  // a tail takes the bytes that w leaves over the element
    const uint64_t a = src | dst;
    if ((a & 15) == 0) copy_flat<uint4>(s, d, w, tid);
    else if ((a & 7) == 0) copy_flat<uint2>(s, d, w, tid);
    else if ((a & 3) == 0) copy_flat<uint32_t>(s, d, w, tid);
    else if ((a & 1) == 0) copy_flat<uint16_t>(s, d, w, tid);
    else copy_flat<uint8_t>(s, d, w, tid);
  } else {  // every row must start aligned and end on an element
    const uint64_t a = src | dst | static_cast<uint64_t>(ss) | static_cast<uint64_t>(ds) | w;
    if ((a & 15) == 0) copy_rows<uint4>(s, d, ss, ds, rows, w, tid);
    else if ((a & 7) == 0) copy_rows<uint2>(s, d, ss, ds, rows, w, tid);
    else if ((a & 3) == 0) copy_rows<uint32_t>(s, d, ss, ds, rows, w, tid);
    else if ((a & 1) == 0) copy_rows<uint16_t>(s, d, ss, ds, rows, w, tid);
    else copy_rows<uint8_t>(s, d, ss, ds, rows, w, tid);
  }
}

template <bool kDeviceBases>
__global__ void __launch_bounds__(kThreads) copy_tasks_kernel(const int64_t* __restrict__ tasks,
                                                              const uint64_t* __restrict__ device_bases,
                                                              const SlotBases bases) {
  const int64_t* f = tasks + int64_t{blockIdx.x} * kTaskFields;  // thread block b runs task b
  const int64_t src_slot = __ldg(f), dst_slot = __ldg(f + 3);
  const uint64_t src_base = kDeviceBases ? __ldg(device_bases + src_slot) : bases.ptr[src_slot];
  const uint64_t dst_base = kDeviceBases ? __ldg(device_bases + dst_slot) : bases.ptr[dst_slot];
  copy_task(src_base + __ldg(f + 1), __ldg(f + 2), dst_base + __ldg(f + 4), __ldg(f + 5),
            static_cast<uint32_t>(__ldg(f + 6)), static_cast<uint32_t>(__ldg(f + 7)), threadIdx.x);
}

}  // namespace cuda_copy

void copy_tasks_cuda(const int64_t* tasks, int64_t n, const int64_t* bases, int64_t nslots,
                     const int64_t* device_bases, std::uintptr_t stream_handle) {
  using namespace cuda_copy;
  if (n < 0 || nslots < 0) throw std::invalid_argument("copy_tasks_cuda: negative task or slot count");
  if (nslots > kMaxSlotArgs && device_bases == nullptr)
    throw std::invalid_argument("copy_tasks_cuda: " + std::to_string(nslots) + " slots need device_bases (at most " +
                                std::to_string(kMaxSlotArgs) + " go by value)");
  if (n == 0) return;
  SlotBases by_value{};
  if (device_bases == nullptr) std::copy(bases, bases + nslots, by_value.ptr);
  const auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
  const auto* dev = reinterpret_cast<const uint64_t*>(device_bases);
  constexpr int64_t kMaxGrid = 0x7fffffff;  // gridDim.x <= 2^31-1
  for (int64_t first = 0; first < n; first += kMaxGrid) {
    const auto grid = static_cast<unsigned>(std::min(n - first, kMaxGrid));
    const int64_t* part = tasks + first * kTaskFields;
    if (dev != nullptr) copy_tasks_kernel<true><<<grid, kThreads, 0, stream>>>(part, dev, by_value);
    else copy_tasks_kernel<false><<<grid, kThreads, 0, stream>>>(part, nullptr, by_value);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess)
      throw std::runtime_error(std::string("copy_tasks_cuda: launch: ") + cudaGetErrorString(err));
  }
}

}  // namespace yatt
