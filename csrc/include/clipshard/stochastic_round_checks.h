#pragma once
// Argument checks shared by the CPU and CUDA stochastic-rounding kernels (host code, uses ATen).
#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>

namespace clipshard {

inline void check_stochastic_round_args(const char* op, const at::Tensor& src, at::ScalarType dtype) {
  TORCH_CHECK(src.scalar_type() == at::kFloat, "clipshard::", op,
              ": src must be a float32 tensor, got ", src.scalar_type());
  TORCH_CHECK(dtype == at::kHalf || dtype == at::kBFloat16, "clipshard::", op,
              ": dtype must be Half or BFloat16, got ", dtype);
}

inline void check_stochastic_round_into_args(const at::Tensor& dst, const at::Tensor& src) {
  check_stochastic_round_args("stochastic_round_into", src, dst.scalar_type());
  TORCH_CHECK(dst.sizes() == src.sizes(), "clipshard::stochastic_round_into: dst and src must have the ",
              "same shape, got ", dst.sizes(), " and ", src.sizes());
  TORCH_CHECK(dst.device() == src.device(), "clipshard::stochastic_round_into: dst and src must be on ",
              "the same device, got ", dst.device(), " and ", src.device());
  at::assert_no_internal_overlap(dst);
  at::assert_no_overlap(dst, src);
}

}  // namespace clipshard
