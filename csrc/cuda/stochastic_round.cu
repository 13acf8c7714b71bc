// CUDA kernels of clipshard::stochastic_round and clipshard::stochastic_round_into: fp32 ->
// fp16/bf16 with Philox random bits (docs/stochastic_rounding.md). Same header maths as the CPU
// kernels, integer only, and the random word of an element depends on its index alone, so the
// results equal the CPU ones bit for bit whatever the launch grid.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>

#include "clipshard/stochastic_round_checks.h"
#include "stochastic_round_kernels.cuh"

namespace clipshard {
namespace {

using namespace stochastic_round_kernels;

template <bool kBf16, bool kSaturate>
void launch(const uint32_t* src, uint16_t* dst, int64_t n, uint64_t seed, uint64_t offset) {
  const bool aligned = reinterpret_cast<uintptr_t>(src) % 16 == 0 && reinterpret_cast<uintptr_t>(dst) % 16 == 0;
  const int64_t work = aligned ? std::max<int64_t>(n / 8, 1) : (n + 3) / 4;  // per-thread steps
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t wanted = (work + kThreads - 1) / kThreads;
  const int grid = static_cast<int>(std::min<int64_t>(wanted, static_cast<int64_t>(sms) * 8));
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  if (aligned) {
    round_vectorized_kernel<kBf16, kSaturate><<<grid, kThreads, 0, stream>>>(src, dst, n, seed, offset);
  } else {
    round_scalar_kernel<kBf16, kSaturate><<<grid, kThreads, 0, stream>>>(src, dst, n, seed, offset);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Rounds a contiguous fp32 tensor into a contiguous 16-bit tensor of the same size.
void round_into_contiguous(at::Tensor& dst, const at::Tensor& src, uint64_t seed, uint64_t offset,
                           bool saturate) {
  const int64_t n = src.numel();
  if (n == 0) return;
  const auto* in = static_cast<const uint32_t*>(src.const_data_ptr());
  auto* out = static_cast<uint16_t*>(dst.mutable_data_ptr());
  if (dst.scalar_type() == at::kBFloat16) {
    saturate ? launch<true, true>(in, out, n, seed, offset) : launch<true, false>(in, out, n, seed, offset);
  } else {
    saturate ? launch<false, true>(in, out, n, seed, offset) : launch<false, false>(in, out, n, seed, offset);
  }
}

at::Tensor stochastic_round_cuda(const at::Tensor& src, at::ScalarType dtype, int64_t seed, int64_t offset,
                                 bool saturate) {
  check_stochastic_round_args("stochastic_round", src, dtype);
  const c10::cuda::OptionalCUDAGuard guard(src.device());
  // Random words follow the row-major index, so a strided source is made contiguous first.
  const at::Tensor in = src.contiguous();
  at::Tensor out = at::empty(src.sizes(), src.options().dtype(dtype));
  round_into_contiguous(out, in, static_cast<uint64_t>(seed), static_cast<uint64_t>(offset), saturate);
  return out;
}

void stochastic_round_into_cuda(at::Tensor& dst, const at::Tensor& src, int64_t seed, int64_t offset,
                                bool saturate) {
  check_stochastic_round_into_args(dst, src);
  const c10::cuda::OptionalCUDAGuard guard(dst.device());
  const at::Tensor in = src.contiguous();
  if (dst.is_contiguous()) {
    round_into_contiguous(dst, in, static_cast<uint64_t>(seed), static_cast<uint64_t>(offset), saturate);
    return;
  }
  // A strided destination: round into a contiguous buffer, then copy into dst's own storage.
  at::Tensor buffer = at::empty(dst.sizes(), dst.options().memory_format(at::MemoryFormat::Contiguous));
  round_into_contiguous(buffer, in, static_cast<uint64_t>(seed), static_cast<uint64_t>(offset), saturate);
  dst.copy_(buffer);
}

}  // namespace
}  // namespace clipshard

TORCH_LIBRARY_IMPL(clipshard, CUDA, m) {
  m.impl("stochastic_round", &clipshard::stochastic_round_cuda);
  m.impl("stochastic_round_into", &clipshard::stochastic_round_into_cuda);
}
