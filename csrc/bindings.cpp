// The yatt._C extension module. Thin pybind11 layer: argument checking and documentation live
// in the C++ kernels (partition.h) and the Python wrappers (yatt/balance.py).
// C++ std::invalid_argument surfaces as ValueError; the GIL is released while a kernel runs.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "partition.h"

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
  m.doc() = "YATT native kernels (C++17). Use the wrappers in yatt.balance.";
  const auto nogil = py::call_guard<py::gil_scoped_release>();

  m.def("karmarkar_karp", &yatt::karmarkar_karp, py::arg("costs"), py::arg("k"),
        py::arg("equal_size") = false, nogil,
        "k-way Karmarkar-Karp partition of int64 costs -> k lists of indices.");
  m.def("greedy_partition", &yatt::greedy_partition, py::arg("costs"), py::arg("k"),
        py::arg("equal_size") = false, nogil,
        "Greedy LPT partition of int64 costs -> k lists of indices.");
  m.def("split_micro_batches", &yatt::split_micro_batches, py::arg("lengths"),
        py::arg("max_tokens"), nogil,
        "Fewest KK-balanced micro-batches of at most max_tokens tokens -> lists of indices.");

#ifdef YATT_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
}
