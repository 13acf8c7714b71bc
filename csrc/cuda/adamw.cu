// CUDA kernel of clipshard::adamw_step_: checks the arguments and launches the multi-tensor kernel
// of adamw_kernels.cuh (the kernel, its table and the launcher are explained there).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../adamw_args.h"
#include "adamw_kernels.cuh"

namespace clipshard {
namespace {

using adamw_cuda::LaunchShape;

void adamw_step_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                     at::TensorList exp_avg_sqs, at::IntArrayRef steps, double lr, double beta1,
                     double beta2, double eps, double weight_decay, bool maximize,
                     bool stochastic_rounding, int64_t seed, int64_t offset,
                     at::OptionalIntArrayRef tensor_numbers, at::OptionalIntArrayRef index_bases) {
  const AdamWArgs a = make_adamw_args(params, grads, exp_avgs, exp_avg_sqs, steps, lr, beta1, beta2,
                                      eps, weight_decay, maximize, stochastic_rounding, seed, offset,
                                      tensor_numbers, index_bases, at::kCUDA);
  if (a.numel.empty()) return;
  for (int64_t numel : a.numel) {
    TORCH_CHECK((numel + 3 + LaunchShape::kChunk - 1) / LaunchShape::kChunk <= INT32_MAX,
                "adamw_step_: tensor too large");
  }
  const c10::cuda::CUDAGuard guard(params[0].device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  dispatch_storage(a.param_storage, a.state_storage, [&](auto p, auto s) {
    constexpr Storage P = decltype(p)::value, S = decltype(s)::value;
    adamw_cuda::launch_all<P, LaunchShape>(a, [&](const adamw_cuda::TensorTable<LaunchShape>& table, int blocks) {
      adamw_cuda::adamw_kernel<P, S, LaunchShape><<<blocks, LaunchShape::kThreads, 0, stream>>>(
          table, a.hyper, a.stochastic, a.seed, a.offset);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

}  // namespace
}  // namespace clipshard

TORCH_LIBRARY_IMPL(clipshard, CUDA, m) { m.impl("adamw_step_", &clipshard::adamw_step_cuda); }
