// The yatt._C extension module. Thin pybind11 layer: argument checking and documentation live
// in the C++ kernels (partition.h, copy_blocks.h) and the Python wrappers (yatt/balance.py,
// yatt/reshard/).
// C++ std::invalid_argument surfaces as ValueError; the GIL is released while a kernel runs.
#include <pybind11/pybind11.h>
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <stdexcept>

#include "copy_blocks.h"
#include "dp_balance.h"
#include "partition.h"

namespace py = pybind11;

namespace {

using Plan = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;
using Slots = Plan;  // 1-D: one int64 address per slot

py::array_t<int64_t> to_array(const std::vector<int64_t>& v) {
  py::array_t<int64_t> out(static_cast<py::ssize_t>(v.size()));
  std::copy(v.begin(), v.end(), out.mutable_data());
  return out;
}

// Checks the shape of a copy plan ([n, 6] int64); returns n.
int64_t plan_rows(const Plan& plan) {
  if (plan.ndim() != 2 || plan.shape(1) != yatt::kBlockFields)
    throw std::invalid_argument("copy plan must be an int64 array of shape [n, 6]");
  return plan.shape(0);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "YATT native kernels (C++17). Use the wrappers in yatt.balance.";
  const auto nogil = py::call_guard<py::gil_scoped_release>();

  m.def("karmarkar_karp", &yatt::karmarkar_karp, py::arg("costs"), py::arg("k"),
        py::arg("equal_size") = false, nogil,
        "k-way Karmarkar-Karp partition of int64 costs -> k lists of indices.");
  m.def("greedy_partition", &yatt::greedy_partition, py::arg("costs"), py::arg("k"),
        py::arg("equal_size") = false, nogil,
        "Greedy LPT partition of int64 costs -> k lists of indices.");
  m.def("copy_blocks_cpu", [](const Plan& plan, int threads) {
          const int64_t n = plan_rows(plan);
          const int64_t* blocks = plan.data();
          py::gil_scoped_release release;
          yatt::plan_bytes(blocks, n);  // validates
          yatt::copy_blocks_cpu(blocks, n, threads);
        }, py::arg("plan"), py::arg("threads") = 0,
        "Execute a copy plan ([n, 6] int64: src, src_stride, dst, dst_stride, rows, row_bytes) "
        "with `threads` CPU threads (0: all cores).");
#ifdef YATT_WITH_CUDA
  m.def("copy_tasks_cuda", [](std::uintptr_t tasks, int64_t n, const Slots& bases, std::uintptr_t stream,
                              std::uintptr_t device_bases) {
          if (bases.ndim() != 1) throw std::invalid_argument("slot bases must be a 1-D int64 array");
          const int64_t nslots = bases.shape(0);
          const int64_t* host = bases.data();
          py::gil_scoped_release release;
          yatt::copy_tasks_cuda(reinterpret_cast<const int64_t*>(tasks), n, host, nslots,
                                reinterpret_cast<const int64_t*>(device_bases), stream);
        }, py::arg("tasks"), py::arg("n"), py::arg("bases"), py::arg("stream") = 0, py::arg("device_bases") = 0,
        "Queue a resident task table (device address of n x 8 int64) on `stream` with the slots' base "
        "addresses (int64 array; by value up to copy_tasks_max_slots, else device_bases is required).");
  m.attr("copy_tasks_max_slots") = yatt::kMaxSlotArgs;
#endif
  m.def("dp_balance", [](const py::array_t<int64_t, py::array::c_style | py::array::forcecast>& array,
                         int64_t ranks, int64_t max_tokens, double cost_linear, double cost_quadratic,
                         bool equal_count) {
          if (array.ndim() != 1) throw std::invalid_argument("lengths must be 1-D");
          const std::vector<int64_t> lengths(array.data(), array.data() + array.shape(0));
          yatt::DpPlan plan;
          {
            py::gil_scoped_release release;
            plan = yatt::dp_balance(lengths, ranks, max_tokens, cost_linear, cost_quadratic, equal_count);
          }
          py::dict out;
          out["order"] = to_array(plan.order);
          out["rank_offsets"] = to_array(plan.rank_offsets);
          out["mb_offsets"] = to_array(plan.mb_offsets);
          out["mb_rank_offsets"] = to_array(plan.mb_rank_offsets);
          out["rank_cost"] = to_array(plan.rank_cost);
          out["costs"] = to_array(plan.costs);
          return out;
        }, py::arg("lengths"), py::arg("ranks"), py::arg("max_tokens"), py::arg("cost_linear") = 1.0,
        py::arg("cost_quadratic") = 0.0, py::arg("equal_count") = false,
        "Fused DP balancer: lengths -> {order, rank_offsets, mb_offsets, mb_rank_offsets, rank_cost, costs}.");
  m.def("split_micro_batches", &yatt::split_micro_batches, py::arg("lengths"),
        py::arg("max_tokens"), nogil,
        "Fewest KK-balanced micro-batches of at most max_tokens tokens -> lists of indices.");

#ifdef YATT_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
}
