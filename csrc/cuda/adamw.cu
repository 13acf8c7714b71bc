// CUDA kernel of clipshard::adamw_step_: a multi-tensor kernel. The host packs up to kMaxTensors
// tensors and kMaxBlocks chunks of kChunk elements into a table passed by value (under the 4 KB
// kernel-parameter limit) and launches once per table, so a step over thousands of parameters
// takes a few launches. Each thread updates groups of 4 consecutive elements whose global indices
// (index_base + local index, clipshard/adamw.h) form one Philox block: with an index base that is
// not a multiple of 4 (a shard of a larger parameter), the groups start lead = index_base % 4
// elements before the tensor and the first group's leading lanes are masked. 16-byte / 8-byte
// vector loads and stores where a group is whole and aligned. Same maths as the CPU kernel
// (clipshard/adamw.h), so results are bitwise identical.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../adamw_args.h"
#include "clipshard/adamw.h"
#include "clipshard/philox.h"

namespace clipshard {
namespace {

constexpr int kMaxTensors = 36;
constexpr int kMaxBlocks = 320;
constexpr int kThreads = 512;
constexpr int64_t kChunk = 65536;  // elements per CUDA block (a multiple of 4 * kThreads)

struct TensorTable {
  void* params[kMaxTensors];
  const void* grads[kMaxTensors];
  void* exp_avgs[kMaxTensors];
  void* exp_avg_sqs[kMaxTensors];
  int64_t numel[kMaxTensors];
  float neg_step_size[kMaxTensors];
  float bc2_sqrt[kMaxTensors];
  int64_t index_base[kMaxTensors];  // global index of element 0
  uint32_t stream[kMaxTensors];      // 3 * the tensor number
  uint8_t block_tensor[kMaxBlocks];
  int32_t block_chunk[kMaxBlocks];
};
static_assert(sizeof(TensorTable) + sizeof(AdamWHyper) + 32 <= 4096, "kernel parameters over 4 KB");

// Lane l of the group starting at local index e (possibly negative, see above) exists when
// 0 <= e + l < numel. Pointers are formed only for existing lanes.
__device__ __forceinline__ bool in_tensor(int64_t i, int64_t numel) { return i >= 0 && i < numel; }

template <Storage S>
__device__ __forceinline__ void load4(const void* base, int64_t e, int64_t numel, float out[4]) {
  const bool whole = e >= 0 && e + 4 <= numel;
  if constexpr (S == Storage::kFloat) {
    const float* src = static_cast<const float*>(base);
    if (whole && (reinterpret_cast<uintptr_t>(src + e) & 15u) == 0) {
      const float4 x = *reinterpret_cast<const float4*>(src + e);
      out[0] = x.x; out[1] = x.y; out[2] = x.z; out[3] = x.w;
    } else {
#pragma unroll
      for (int l = 0; l < 4; ++l) out[l] = in_tensor(e + l, numel) ? src[e + l] : 0.0f;
    }
  } else {
    const uint16_t* src = static_cast<const uint16_t*>(base);
    uint16_t bits[4];
    if (whole && (reinterpret_cast<uintptr_t>(src + e) & 7u) == 0) {
      const uint2 x = *reinterpret_cast<const uint2*>(src + e);
      bits[0] = x.x & 0xffffu; bits[1] = x.x >> 16; bits[2] = x.y & 0xffffu; bits[3] = x.y >> 16;
    } else {
#pragma unroll
      for (int l = 0; l < 4; ++l) bits[l] = in_tensor(e + l, numel) ? src[e + l] : uint16_t(0);
    }
#pragma unroll
    for (int l = 0; l < 4; ++l) out[l] = storage_to_float<S>(bits[l]);
  }
}

// global: index_base + e, a multiple of 4 (the group's Philox block is global / 4).
template <Storage S>
__device__ __forceinline__ void store4(void* base, int64_t e, int64_t numel, const float in[4], bool stochastic,
                                       uint64_t seed, uint64_t offset, uint64_t stream, uint64_t global) {
  const bool whole = e >= 0 && e + 4 <= numel;
  if constexpr (S == Storage::kFloat) {
    float* dst = static_cast<float*>(base);
    float out[4];
#pragma unroll
    for (int l = 0; l < 4; ++l) out[l] = canonical_float(in[l]);
    if (whole && (reinterpret_cast<uintptr_t>(dst + e) & 15u) == 0) {
      *reinterpret_cast<float4*>(dst + e) = make_float4(out[0], out[1], out[2], out[3]);
    } else {
#pragma unroll
      for (int l = 0; l < 4; ++l) if (in_tensor(e + l, numel)) dst[e + l] = out[l];
    }
  } else {
    uint16_t* dst = static_cast<uint16_t*>(base);
    PhiloxWords words = {{0u, 0u, 0u, 0u}};
    if (stochastic) words = philox_block(seed, offset, stream_block(stream, global));
    uint16_t bits[4];
#pragma unroll
    for (int l = 0; l < 4; ++l) bits[l] = round_to_storage<S>(in[l], words.w[l], stochastic);
    if (whole && (reinterpret_cast<uintptr_t>(dst + e) & 7u) == 0) {
      *reinterpret_cast<uint2*>(dst + e) = make_uint2(bits[0] | (uint32_t(bits[1]) << 16),
                                                      bits[2] | (uint32_t(bits[3]) << 16));
    } else {
#pragma unroll
      for (int l = 0; l < 4; ++l) if (in_tensor(e + l, numel)) dst[e + l] = bits[l];
    }
  }
}

template <Storage P, Storage S>
__global__ void __launch_bounds__(kThreads) adamw_kernel(TensorTable table, AdamWHyper hyper, bool stochastic,
                                                         uint64_t seed, uint64_t offset) {
  const int t = table.block_tensor[blockIdx.x];
  const int64_t numel = table.numel[t];
  const int64_t lead = table.index_base[t] & 3;  // groups start at local index -lead
  const int64_t begin = static_cast<int64_t>(table.block_chunk[blockIdx.x]) * kChunk - lead;
  const int64_t end = begin + kChunk < numel ? begin + kChunk : numel;
  const float neg_step_size = table.neg_step_size[t], bc2_sqrt = table.bc2_sqrt[t];
  const uint64_t stream = table.stream[t];
  for (int64_t e = begin + 4 * static_cast<int64_t>(threadIdx.x); e < end; e += 4 * kThreads) {
    const uint64_t global = static_cast<uint64_t>(table.index_base[t] + e);
    float p[4], g[4], m[4], v[4];
    load4<P>(table.params[t], e, numel, p);
    load4<P>(table.grads[t], e, numel, g);
    load4<S>(table.exp_avgs[t], e, numel, m);
    load4<S>(table.exp_avg_sqs[t], e, numel, v);
#pragma unroll
    for (int l = 0; l < 4; ++l) {
      if constexpr (S == Storage::kHalf) v[l] = decode_fourth_root(v[l]);
      adamw_update(p[l], g[l], m[l], v[l], hyper, neg_step_size, bc2_sqrt);
      if constexpr (S == Storage::kHalf) v[l] = encode_fourth_root(v[l]);
    }
    store4<P>(table.params[t], e, numel, p, stochastic, seed, offset, stream + 0, global);
    store4<S>(table.exp_avgs[t], e, numel, m, stochastic, seed, offset, stream + 1, global);
    store4<S>(table.exp_avg_sqs[t], e, numel, v, stochastic, seed, offset, stream + 2, global);
  }
}

template <Storage P, Storage S>
void launch_all(const AdamWArgs& a, cudaStream_t stream) {
  TensorTable table;
  int slot = 0, blocks = 0;
  auto set_slot = [&](int s, size_t t) {
    table.params[s] = a.params[t];
    table.grads[s] = a.grads[t];
    table.exp_avgs[s] = a.exp_avgs[t];
    table.exp_avg_sqs[s] = a.exp_avg_sqs[t];
    table.numel[s] = a.numel[t];
    table.neg_step_size[s] = a.neg_step_size[t];
    table.bc2_sqrt[s] = a.bc2_sqrt[t];
    table.index_base[s] = a.index_base[t];
    table.stream[s] = a.stream[t];
  };
  auto launch = [&]() {
    adamw_kernel<P, S><<<blocks, kThreads, 0, stream>>>(table, a.hyper, a.stochastic, a.seed, a.offset);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    blocks = 0;
  };
  for (size_t t = 0; t < a.numel.size(); ++t) {
    if (a.numel[t] == 0) continue;
    set_slot(slot, t);
    const int64_t chunks = (a.numel[t] + (a.index_base[t] & 3) + kChunk - 1) / kChunk;  // (see the kernel)
    for (int64_t c = 0; c < chunks; ++c) {
      table.block_tensor[blocks] = static_cast<uint8_t>(slot);
      table.block_chunk[blocks] = static_cast<int32_t>(c);
      ++blocks;
      const bool last_chunk = c + 1 == chunks;
      if (blocks == kMaxBlocks || (last_chunk && slot + 1 == kMaxTensors)) {
        launch();
        if (last_chunk) {
          slot = -1;  // the next tensor starts a fresh table
        } else {
          set_slot(0, t);  // the rest of this tensor continues in slot 0
          slot = 0;
        }
      }
    }
    ++slot;
  }
  if (blocks > 0) launch();
}

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
    TORCH_CHECK((numel + 3 + kChunk - 1) / kChunk <= INT32_MAX, "adamw_step_: tensor too large");
  }
  const c10::cuda::CUDAGuard guard(params[0].device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  dispatch_storage(a.param_storage, a.state_storage, [&](auto p, auto s) {
    launch_all<decltype(p)::value, decltype(s)::value>(a, stream);
  });
}

}  // namespace
}  // namespace clipshard

TORCH_LIBRARY_IMPL(clipshard, CUDA, m) { m.impl("adamw_step_", &clipshard::adamw_step_cuda); }
