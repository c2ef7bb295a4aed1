// Block copies for weight resharding (yatt/reshard): the executor of a copy plan.
//
// A plan is n blocks, one row of 6 int64 each (all in bytes, addresses absolute):
//   [src_addr, src_stride, dst_addr, dst_stride, rows, row_bytes]
// Block b copies `rows` rows of `row_bytes` bytes; row k goes from src_addr + k*src_stride to
// dst_addr + k*dst_stride. A contiguous run is one row (rows = 1). The planner (Python) guarantees
// that destinations do not overlap each other or any source; blocks may come in any order.
// The CPU executes such plans (copy_blocks_cpu); CUDA executes slot-relative task tables
// (copy_tasks_cuda), which stay resident on the device while only the slot addresses change.
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
// Copy tasks (built by yatt/reshard/kernel.py, CopyProgram.tasks): n rows of 8 int64, in bytes,
// relative to the base addresses of numbered buffers ("slots"):
//   [src_slot, src_off, src_stride, dst_slot, dst_off, dst_stride, rows, row_bytes]
// Task k copies `rows` rows of `row_bytes` bytes; row r goes from bases[src_slot] + src_off +
// r*src_stride to bases[dst_slot] + dst_off + r*dst_stride (strides are ignored when rows = 1).
// The planner guarantees rows >= 1, row_bytes >= 1, rows*row_bytes < 2^31, slots in range, that
// every task stays inside its slots and that destinations overlap no destination or source.
constexpr int kTaskFields = 8;
// Slots whose bases travel by value in the launch (a 2 KiB kernel parameter, under the 4 KiB
// limit); programs with more slots pass `device_bases`.
constexpr int kMaxSlotArgs = 256;

// One stream-ordered launch (one per 2^31-1 tasks) of the n tasks at `tasks` (device memory,
// n x kTaskFields int64; one thread block per task, so tasks of about 32 KiB keep it fast) on
// `stream` (a cudaStream_t as an integer; 0 = default) of the current device. `bases` (host,
// nslots int64 device addresses) are passed by value when nslots <= kMaxSlotArgs; otherwise the
// kernel reads `device_bases` (device memory, nslots int64, alive until the copy has run).
// Returns once queued, without synchronising: work on `stream` after it sees the copy; other
// streams must wait on an event. Throws std::invalid_argument on nslots > kMaxSlotArgs without
// device_bases (or a negative n / nslots) and std::runtime_error on a CUDA launch error.
void copy_tasks_cuda(const int64_t* tasks, int64_t n, const int64_t* bases, int64_t nslots,
                     const int64_t* device_bases, std::uintptr_t stream);
#endif

}  // namespace yatt
