// An internal op that reports chunk_driver.h's addmm probe, so that tests can check both of its
// answers on a CPU-only machine (the CPU refuses, the meta device accepts) and the GPU check can
// print which backward path the machine's torch takes.
#include <torch/library.h>

#include "chunk_driver.h"

namespace {

bool addmm_accepts_fp32_accumulator_op(c10::Device device, c10::ScalarType factors) {
  return clipshard::chunked::addmm_accepts_fp32_accumulator(device, factors);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(clipshard, m) {
  // True when torch's addmm.dtype_out takes an fp32 accumulator with `factors`-typed factors on
  // `device`'s type (probed once and cached; CLIPSHARD_ADDMM_FP32_ACCUMULATOR=0 forces false).
  m.def("_addmm_accepts_fp32_accumulator(Device device, ScalarType factors) -> bool",
        &addmm_accepts_fp32_accumulator_op);
}
