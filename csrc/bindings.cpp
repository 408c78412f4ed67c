// The `atom._C` module. Every function takes device addresses as integers,
// sizes and a raw stream handle, so this module never links against torch's
// C++ ABI; atom/ops/*.py derives those arguments from tensors.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>

#include "ops.h"

namespace py = pybind11;

namespace {

void check(const char* error) {
  if (error != nullptr) throw std::runtime_error(error);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "ATOM's compiled CUDA/HIP kernels (raw-pointer bindings)";
#ifdef ATOM_BACKEND_HIP
  m.attr("backend") = "hip";
#else
  m.attr("backend") = "cuda";
#endif

  m.def(
      "gather_blocks",
      [](uintptr_t cache, int64_t block_stride, uintptr_t block_ids, int64_t num_ids,
         uintptr_t staging, int64_t block_bytes, uintptr_t stream) {
        check(atom::gather_blocks(cache, block_stride, block_ids, num_ids, staging, block_bytes,
                                  stream));
      },
      "staging[i] = cache block block_ids[i], for i < num_ids", py::arg("cache"),
      py::arg("block_stride"), py::arg("block_ids"), py::arg("num_ids"), py::arg("staging"),
      py::arg("block_bytes"), py::arg("stream"));

  m.def(
      "scatter_blocks",
      [](uintptr_t cache, int64_t block_stride, uintptr_t block_ids, int64_t num_ids,
         uintptr_t staging, int64_t block_bytes, uintptr_t stream) {
        check(atom::scatter_blocks(cache, block_stride, block_ids, num_ids, staging, block_bytes,
                                   stream));
      },
      "cache block block_ids[i] = staging[i], for i < num_ids", py::arg("cache"),
      py::arg("block_stride"), py::arg("block_ids"), py::arg("num_ids"), py::arg("staging"),
      py::arg("block_bytes"), py::arg("stream"));
}
