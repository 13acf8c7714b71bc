// Host emulation of the few CUDA features the FMA kernels of csrc/cuda/contrastive_lse_kernels.cuh
// use, so that their indexing, masking and reductions can be checked on a machine without a GPU:
// one fiber (a ucontext with its own stack) per CUDA thread, all on the calling thread, one block
// at a time (so `static` locals are shared memory); __syncthreads switches to the next fiber, and a
// block's fibers run round-robin from one barrier to the next; warp shuffles go through a
// block-wide exchange buffer. Fibers instead of OS threads: a barrier costs a user-space context
// switch instead of waking every thread of the block through the OS scheduler (on two cores the
// chunked and distillation harnesses ran 2-3x longer with one std::thread per CUDA thread).
// Not a CUDA simulator: no memory model, no warp divergence rules; all threads of a block must
// reach every barrier and shuffle, which the kernels guarantee anyway (a block whose threads do not
// stops the harness with a message).
#pragma once

#include <ucontext.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <vector>

#define __device__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))

struct alignas(16) uint4 {
  uint32_t x, y, z, w;
};
inline uint4 make_uint4(uint32_t x, uint32_t y, uint32_t z, uint32_t w) { return {x, y, z, w}; }

// 16- and 8-byte vector types. Every copy through one (a vector load or store of a kernel) is
// counted in g_vector_accesses, so that a harness can tell which path a kernel took, and stops the
// harness when either end is not aligned to the type's size (a GPU faults: misaligned address).
inline long long g_vector_accesses = 0;
inline void vector_access(const void* a, const void* b, uintptr_t bytes) {
  if ((reinterpret_cast<uintptr_t>(a) | reinterpret_cast<uintptr_t>(b)) % bytes != 0) {
    std::fprintf(stderr, "emulate_cuda: misaligned %u-byte vector access (%p <- %p)\n", unsigned(bytes), a, b);
    std::abort();
  }
  ++g_vector_accesses;
}
struct alignas(16) float4 {
  float x, y, z, w;
  float4(float a, float b, float c, float d) : x(a), y(b), z(c), w(d) {}
  float4(const float4& o) : x(o.x), y(o.y), z(o.z), w(o.w) { vector_access(this, &o, 16); }
  float4& operator=(const float4& o) {
    x = o.x, y = o.y, z = o.z, w = o.w;
    vector_access(this, &o, 16);
    return *this;
  }
};
inline float4 make_float4(float x, float y, float z, float w) { return float4(x, y, z, w); }
struct alignas(8) uint2 {
  uint32_t x, y;
  uint2(uint32_t a, uint32_t b) : x(a), y(b) {}
  uint2(const uint2& o) : x(o.x), y(o.y) { vector_access(this, &o, 8); }
  uint2& operator=(const uint2& o) {
    x = o.x, y = o.y;
    vector_access(this, &o, 8);
    return *this;
  }
};
inline uint2 make_uint2(uint32_t x, uint32_t y) { return uint2(x, y); }

struct dim3 {
  unsigned x = 0, y = 0, z = 0;
};
inline thread_local dim3 threadIdx, blockIdx, gridDim, blockDim;

// One block's fibers: their contexts and stacks, where each one stands, and the scheduler's context.
struct EmulatedBlock {
  enum State : char { kRunnable, kAtBarrier, kDone };
  static constexpr size_t kStackBytes = 1 << 20;  // malloc maps it lazily: untouched pages cost nothing
  std::vector<ucontext_t> fibers;
  std::vector<std::unique_ptr<char[]>> stacks;
  std::vector<State> states;
  ucontext_t scheduler;
  std::function<void()> body;  // the kernel with its arguments, run by every fiber
  float exchange[1024];
  const void* pointers[1024];
  uint32_t words[1024][6];
};
inline EmulatedBlock* g_block = nullptr;

inline void __syncthreads() {
  const unsigned t = threadIdx.x;
  g_block->states[t] = EmulatedBlock::kAtBarrier;
  swapcontext(&g_block->fibers[t], &g_block->scheduler);  // back here once every thread arrived
}

// Every thread publishes v, then reads lane `src_lane` of its own warp (own value if out of range).
inline float emulated_shuffle(float v, int src_lane) {
  const int t = static_cast<int>(threadIdx.x), lane = t % 32;
  g_block->exchange[t] = v;
  __syncthreads();
  const float out = (src_lane >= 0 && src_lane < 32) ? g_block->exchange[t - lane + src_lane] : v;
  __syncthreads();
  return out;
}

inline float __shfl_xor_sync(unsigned, float v, int lane_mask, int width = 32) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int segment = lane / width * width;
  return emulated_shuffle(v, segment + ((lane - segment) ^ lane_mask) % width);
}

inline float __shfl_down_sync(unsigned, float v, unsigned offset) {
  return emulated_shuffle(v, static_cast<int>(threadIdx.x % 32 + offset));
}

inline void emulated_fiber_main() {
  g_block->body();
  g_block->states[threadIdx.x] = EmulatedBlock::kDone;  // returns to uc_link, the scheduler
}

// Runs one block: every fiber from the start of the kernel, then round-robin, each until its next
// barrier, until all have returned. Every thread must reach the same barriers, as on a GPU.
inline void emulate_block(EmulatedBlock& block) {
  const unsigned n = static_cast<unsigned>(block.fibers.size());
  for (unsigned t = 0; t < n; ++t) {
    getcontext(&block.fibers[t]);
    block.fibers[t].uc_stack.ss_sp = block.stacks[t].get();
    block.fibers[t].uc_stack.ss_size = EmulatedBlock::kStackBytes;
    block.fibers[t].uc_link = &block.scheduler;
    makecontext(&block.fibers[t], emulated_fiber_main, 0);
    block.states[t] = EmulatedBlock::kRunnable;
  }
  for (;;) {
    unsigned done = 0;
    for (unsigned t = 0; t < n; ++t) {
      threadIdx.x = t;
      swapcontext(&block.scheduler, &block.fibers[t]);
      done += block.states[t] == EmulatedBlock::kDone;
    }
    if (done == n) return;
    if (done != 0) {
      std::fprintf(stderr, "emulate_cuda.h: %u of %u threads of block (%u, %u) returned while the others wait at "
                   "a barrier\n", done, n, blockIdx.x, blockIdx.y);
      std::abort();
    }
    for (auto& state : block.states) state = EmulatedBlock::kRunnable;
  }
}

// kernel<<<grid, block>>>(params) for a 2-D grid, blocks one after another, each as `block` fibers.
template <typename Kernel, typename Params>
void emulate_launch(Kernel kernel, dim3 grid, unsigned block, const Params& params) {
  auto state = std::make_unique<EmulatedBlock>();
  state->fibers.resize(block);
  state->states.resize(block);
  for (unsigned t = 0; t < block; ++t) state->stacks.emplace_back(new char[EmulatedBlock::kStackBytes]);
  state->body = [&] { kernel(params); };
  g_block = state.get();
  gridDim = grid;
  blockDim = dim3{block, 1, 1};
  for (unsigned by = 0; by < grid.y; ++by)
    for (unsigned bx = 0; bx < grid.x; ++bx) {
      blockIdx.x = bx;
      blockIdx.y = by;
      emulate_block(*state);
    }
  g_block = nullptr;
}

// kernel<<<grid, block>>>(params) for a 1-D grid.
template <typename Kernel, typename Params>
void emulate_launch(Kernel kernel, unsigned grid, unsigned block, const Params& params) {
  emulate_launch(kernel, dim3{grid, 1, 1}, block, params);
}

// kernel<<<grid, block>>> for a kernel without barriers or shuffles (body() runs the kernel with its
// arguments): the threads run one after another on this thread.
template <typename Body>
void emulate_launch_sequential(unsigned grid, unsigned block, Body body) {
  gridDim = dim3{grid, 1, 1};
  blockDim = dim3{block, 1, 1};
  for (unsigned bx = 0; bx < grid; ++bx)
    for (unsigned t = 0; t < block; ++t) {
      blockIdx.x = bx;
      threadIdx.x = t;
      body();
    }
}
