// Block copies for weight resharding (yatt/reshard): the executor of a copy plan.
//
// A plan is n blocks, one row of 6 int64 each (all in bytes, addresses absolute):
//   [src_addr, src_stride, dst_addr, dst_stride, rows, row_bytes]
// Block b copies `rows` rows of `row_bytes` bytes; row k goes from src_addr + k*src_stride to
// dst_addr + k*dst_stride. A contiguous run is one row (rows = 1). The planner (Python) guarantees
// that destinations do not overlap each other or any source; blocks may come in any order.
// The CPU and CUDA implementations take the same plan; CUDA addresses are device pointers.
#pragma once

#include <cstdint>

namespace yatt {

constexpr int kBlockFields = 6;

// Total bytes a plan moves. Throws std::invalid_argument on a negative field or a row longer than
// its stride (rows > 1), which would make consecutive rows overlap.
int64_t plan_bytes(const int64_t* blocks, int64_t n);

// Multi-threaded CPU copy: the plan's bytes are cut into `threads` equal contiguous ranges of the
// concatenated block space (so one huge block is shared by all threads and many tiny blocks are
// spread evenly); each thread memcpy's its range. threads <= 0: std::thread::hardware_concurrency.
// Ranges smaller than 1 MiB per thread use fewer threads. A plan of >= 64 MiB is written with
// non-temporal stores (on CPUs with AVX2; rows and runs of >= 256 bytes): its
// destination does not fit the caches, and regular stores would first read every destination line.
void copy_blocks_cpu(const int64_t* blocks, int64_t n, int threads);

#ifdef YATT_WITH_CUDA
// One CUDA launch for the whole plan on `stream` (a cudaStream_t as an integer; 0 = default).
// `blocks` is host memory; it is copied to the device (stream-ordered) before the launch.
// Returns when the copy is done (the stream is synchronised); throws std::invalid_argument as
// plan_bytes does and std::runtime_error on a CUDA error.
void copy_blocks_cuda(const int64_t* blocks, int64_t n, std::uintptr_t stream);
#endif

}  // namespace yatt
