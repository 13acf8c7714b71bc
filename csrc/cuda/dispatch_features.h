// The feature dtypes of the CUDA loss kernels: calls f(T{}) with the element type of float32,
// float16 or bfloat16 (callers have already refused any other dtype).
#pragma once

#include <ATen/ATen.h>

namespace clipshard {

template <typename F>
void dispatch_features(at::ScalarType dtype, F&& f) {
  switch (dtype) {
    case at::kFloat: return f(float{});
    case at::kHalf: return f(at::Half{});
    case at::kBFloat16: return f(at::BFloat16{});
    default: TORCH_INTERNAL_ASSERT(false, "unsupported dtype ", dtype);
  }
}

}  // namespace clipshard
