// The CUDA kernel of clipshard::adamw_step_ and its launcher, torch-free so that
// tests/cuda_emulation/emulate_adamw.cpp can run them as host code (adamw.cu launches them).
//
// A multi-tensor kernel: the host packs up to kMaxTensors tensors and kMaxBlocks chunks of kChunk
// elements into a table passed by value (under the 4 KB kernel-parameter limit) and launches once
// per table, so a step over thousands of parameters takes a few launches. Each thread updates
// groups of 4 consecutive elements that start where the param's memory is aligned for one 16-byte
// (fp32) or 8-byte (16-bit) access: the groups start lead = (param address / element size) % 4
// elements before the tensor, and the first group's leading lanes are masked. Vector loads and
// stores where a group is whole and the tensor's address at it is aligned (any other tensor of the
// step may sit at another alignment: it then takes the scalar path).
//
// Random words belong to global element indices (index_base + local index, clipshard/adamw.h),
// never to groups: a group whose first global index is not a multiple of 4 (a shard starting mid
// Philox block) takes its lanes' words from two Philox blocks. Same maths as the CPU kernel
// (clipshard/adamw.h), so results are bitwise identical whatever the alignment and index base.
#pragma once

#include <cstdint>

#include "clipshard/adamw.h"
#include "clipshard/philox.h"

namespace clipshard {
namespace adamw_cuda {

// Table sizes and the work of one CUDA block. The emulation also instantiates a smaller shape, so
// that a tensor longer than one table's blocks fits in a test.
struct LaunchShape {
  static constexpr int kMaxTensors = 36;
  static constexpr int kMaxBlocks = 320;
  static constexpr int kThreads = 512;
  static constexpr int64_t kChunk = 65536;  // elements per CUDA block (a multiple of 4 * kThreads)
};

template <class Shape>
struct TensorTable {
  void* params[Shape::kMaxTensors];
  const void* grads[Shape::kMaxTensors];
  void* exp_avgs[Shape::kMaxTensors];
  void* exp_avg_sqs[Shape::kMaxTensors];
  int64_t numel[Shape::kMaxTensors];
  float neg_step_size[Shape::kMaxTensors];
  float bc2_sqrt[Shape::kMaxTensors];
  int64_t index_base[Shape::kMaxTensors];  // global index of element 0
  uint32_t stream[Shape::kMaxTensors];     // 3 * the tensor number
  uint8_t lead[Shape::kMaxTensors];        // elements of the first group before the tensor (0-3)
  uint8_t block_tensor[Shape::kMaxBlocks];
  int32_t block_chunk[Shape::kMaxBlocks];
};
static_assert(sizeof(TensorTable<LaunchShape>) + sizeof(AdamWHyper) + 32 <= 4096, "kernel parameters over 4 KB");
static_assert(LaunchShape::kChunk % (4 * LaunchShape::kThreads) == 0, "a chunk is whole groups of every thread");

// Elements of the first group before the tensor, so that every group starts at an address aligned
// for one vector access of 4 elements of `element_bytes` each.
inline int lead_for_alignment(const void* param, int element_bytes) {
  return static_cast<int>((reinterpret_cast<uintptr_t>(param) / element_bytes) % 4);
}

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

// The random word of each lane of a group whose lane 0 has global index `first` (>= -3: lanes
// before the tensor are never stored, and neither are their words). Lane l's word is word
// (first + l) % 4 of Philox block (first + l) / 4: one block when first is a multiple of 4, else
// two. The 8 words of the two blocks are shifted left by `shift` in two conditional steps (1, then
// 2) whose indices are all compile-time constants: an index known only at run time would put the
// words in a local-memory stack frame.
__device__ __forceinline__ void lane_words(uint64_t seed, uint64_t offset, uint64_t stream, int64_t first,
                                           uint32_t out[4]) {
  const int64_t shift = first & 3;  // lane 0's word in its block (two's complement: also for first < 0)
  const int64_t block = (first - shift) / 4;
  PhiloxWords low = {{0u, 0u, 0u, 0u}}, high = {{0u, 0u, 0u, 0u}};
  if (block >= 0) low = philox_block(seed, offset, stream_block(stream, static_cast<uint64_t>(block) * 4));
  if (shift != 0) high = philox_block(seed, offset, stream_block(stream, static_cast<uint64_t>(block + 1) * 4));
  uint32_t w[7] = {low.w[0], low.w[1], low.w[2], low.w[3], high.w[0], high.w[1], high.w[2]};
  const bool by_one = (shift & 1) != 0, by_two = (shift & 2) != 0;
#pragma unroll
  for (int k = 0; k < 6; ++k) w[k] = by_one ? w[k + 1] : w[k];
#pragma unroll
  for (int l = 0; l < 4; ++l) out[l] = by_two ? w[l + 2] : w[l];
}

// global: the global index of local element e (the group's lane 0).
template <Storage S>
__device__ __forceinline__ void store4(void* base, int64_t e, int64_t numel, const float in[4], bool stochastic,
                                       uint64_t seed, uint64_t offset, uint64_t stream, int64_t global) {
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
    uint32_t words[4] = {0u, 0u, 0u, 0u};
    if (stochastic) lane_words(seed, offset, stream, global, words);
    uint16_t bits[4];
#pragma unroll
    for (int l = 0; l < 4; ++l) bits[l] = round_to_storage<S>(in[l], words[l], stochastic);
    if (whole && (reinterpret_cast<uintptr_t>(dst + e) & 7u) == 0) {
      *reinterpret_cast<uint2*>(dst + e) = make_uint2(bits[0] | (uint32_t(bits[1]) << 16),
                                                      bits[2] | (uint32_t(bits[3]) << 16));
    } else {
#pragma unroll
      for (int l = 0; l < 4; ++l) if (in_tensor(e + l, numel)) dst[e + l] = bits[l];
    }
  }
}

template <Storage P, Storage S, class Shape>
__global__ void __launch_bounds__(Shape::kThreads) adamw_kernel(TensorTable<Shape> table, AdamWHyper hyper,
                                                                bool stochastic, uint64_t seed, uint64_t offset) {
  const int t = table.block_tensor[blockIdx.x];
  const int64_t numel = table.numel[t];
  const int64_t begin = static_cast<int64_t>(table.block_chunk[blockIdx.x]) * Shape::kChunk - table.lead[t];
  const int64_t end = begin + Shape::kChunk < numel ? begin + Shape::kChunk : numel;
  const float neg_step_size = table.neg_step_size[t], bc2_sqrt = table.bc2_sqrt[t];
  const uint64_t stream = table.stream[t];
  for (int64_t e = begin + 4 * static_cast<int64_t>(threadIdx.x); e < end; e += 4 * Shape::kThreads) {
    const int64_t global = table.index_base[t] + e;
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

constexpr int storage_bytes(Storage s) { return s == Storage::kFloat ? 4 : 2; }

// Packs every non-empty tensor of `a` (AdamWArgs, csrc/adamw_args.h) into tables and calls
// launch(table, blocks) once per full table and once for the rest.
template <Storage P, class Shape, class Args, class Launch>
void launch_all(const Args& a, Launch&& launch) {
  TensorTable<Shape> table;
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
    table.lead[s] = static_cast<uint8_t>(lead_for_alignment(a.params[t], storage_bytes(P)));
  };
  auto flush = [&]() {
    launch(table, blocks);
    blocks = 0;
  };
  for (size_t t = 0; t < a.numel.size(); ++t) {
    if (a.numel[t] == 0) continue;
    set_slot(slot, t);
    const int64_t chunks = (a.numel[t] + table.lead[slot] + Shape::kChunk - 1) / Shape::kChunk;  // (see the kernel)
    for (int64_t c = 0; c < chunks; ++c) {
      table.block_tensor[blocks] = static_cast<uint8_t>(slot);
      table.block_chunk[blocks] = static_cast<int32_t>(c);
      ++blocks;
      const bool last_chunk = c + 1 == chunks;
      if (blocks == Shape::kMaxBlocks || (last_chunk && slot + 1 == Shape::kMaxTensors)) {
        flush();
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
  if (blocks > 0) flush();
}

}  // namespace adamw_cuda
}  // namespace clipshard
