// Launches the fp16 gradient pre-scale kernel (fp16_prescale.cuh).
#include "fp16_prescale.h"

#include <ATen/cuda/CUDAContext.h>

#include "fp16_prescale.cuh"

namespace clipshard {

at::Tensor fp16_gradient_prescale(const at::Tensor& scale, const at::Tensor& g_row, const at::Tensor& g_col,
                                  const at::Tensor& g_pos) {
  at::Tensor out = at::empty({2}, g_row.options());
  fp16_prescale::prescale_kernel<<<1, fp16_prescale::kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      scale.const_data_ptr<float>(), g_row.const_data_ptr<float>(), g_row.numel(), g_pos.const_data_ptr<float>(),
      g_col.defined() ? g_col.const_data_ptr<float>() : nullptr, g_col.defined() ? g_col.numel() : 0,
      out.mutable_data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace clipshard
