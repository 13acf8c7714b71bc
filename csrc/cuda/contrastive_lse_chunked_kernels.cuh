// Elementwise kernels of the chunked contrastive log-sum-exp (docs/fused_loss_cuda.md). A GEMM has
// already written one chunk of raw similarities, dots = rows @ cols[begin : begin + width]^T
// (M x width, fp32, row-major); these kernels read it once. Torch-free: plain pointers and sizes.
//
// Geometry of the two chunk kernels: a CTA of kThreads threads owns a block of consecutive rows
// (blockIdx.y; kRowsPerCta rows for the gradient kernel, kRows for the forward kernel) and the
// column steps blockIdx.x, blockIdx.x + gridDim.x, ... of kThreads columns each; a thread owns one
// column of each step, so every warp load reads 128 consecutive bytes.
//
// Sample ids (the kIds variants, chosen when row_ids is not null): the pair (i, j) with row_ids[i]
// == col_ids[j] that is not row i's positive is left out of both log-sum-exps and gets dS = 0. A
// CTA stages its rows' ids in shared memory once; a thread loads its column's id once per column
// step; per logit that is one shared-memory broadcast read and a compare, no M x K mask.
#pragma once

#include <cstdint>

#include "clipshard/launch_rules.h"
#include "clipshard/online_lse.h"

namespace clipshard {
namespace chunked_cuda {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kRowsPerCta = 32;  // rows per CTA of chunk_grad_kernel

// The two variants of chunk_forward_kernel (docs/fused_loss_cuda.md, "Resources per kernel"): 32
// row states per thread (160 registers: one 256-thread CTA per SM) or 16 (two CTAs per SM, no
// spills). contrastive_lse_chunked.cu picks one (launch_rules.h's rule, through csrc/chunked/forward_rows.h).
constexpr int kForwardRowsWide = launch_rules::kChunkedForwardRowsWide;
constexpr int kForwardRowsNarrow = launch_rules::kChunkedForwardRowsNarrow;
// CTAs per SM that __launch_bounds__ asks the compiler to fit for a forward variant.
template <int kRows>
constexpr int kForwardMinCtasPerSm = kRows == kForwardRowsNarrow ? 2 : 1;

using Lse = OnlineLse<float>;

struct ForwardChunkParams {
  const float* dots;
  int64_t M, width, begin;
  const float* scale;   // device scalar
  int64_t pos_offset;   // row i's positive is global column pos_offset + i
  Lse* row_partial;     // [gridDim.x][M]: each column split's state of each row over this chunk
  Lse* col_partial;     // [gridDim.y][width]: each row block's state of each column, or nullptr
  float* pos_logit;     // [M] (unbiased), written by whichever CTA holds the positive
  const int64_t* row_ids = nullptr;  // [M] sample ids, or nullptr (no ids)
  const int64_t* col_ids = nullptr;  // [K] global columns, or nullptr
};

template <typename T>
struct GradChunkParams {
  const float* dots;
  int64_t M, width, begin;
  const float* scale;
  const float* prescale;  // power of two for fp16 dlogits, or nullptr
  const float* row_lse;   // [M], unbiased
  const float* g_row;     // [M]
  const float* g_pos;     // [M]
  const float* col_lse;   // [K] global columns, unbiased, or nullptr (no column term)
  const float* g_col;     // [K] or nullptr
  int64_t pos_offset;
  T* dlogits;              // M x width: prescale * scale * dS
  float* partial_scale;    // [gridDim.y * gridDim.x]: sum of dS * dot per CTA
  float* partial_bias;     // same layout: sum of dS
  const int64_t* row_ids = nullptr;  // [M] sample ids, or nullptr (no ids)
  const int64_t* col_ids = nullptr;  // [K] global columns, or nullptr
};

__device__ __forceinline__ Lse shuffle_xor(const Lse& s, int lane_mask) {
  return {__shfl_xor_sync(0xffffffffu, s.max, lane_mask), __shfl_xor_sync(0xffffffffu, s.sum, lane_mask)};
}

// A warp's kRows row states, one set per lane, reduced so that lane r (r < kRows) ends with row
// r's total: at each of log2(kRows) steps a lane keeps half of its states and merges in its
// partner's copy of that half (kRows - 1 merges per lane instead of log2(kRows) x kRows); lane l
// then holds row l % kRows over the lanes that agree with it in the low bits, and with kRows < 32
// the lanes l, l + kRows, ... are folded together by plain xor shuffles. Every index is a
// compile-time constant (the inner loop has a fixed trip count), so the states stay in registers.
// State: any online state with merge() and a shuffle_xor overload (Lse here; the distillation
// kernels' OnlineSoftmaxMean too).
template <int kRows, typename State = Lse>
__device__ __forceinline__ State warp_reduce_rows(State (&state)[kRows]) {
  static_assert(kRows == 16 || kRows == 32, "a power of two that divides the warp, >= 16");
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int half = kRows / 2; half > 0; half /= 2) {
    const bool upper = (lane & half) != 0;
#pragma unroll
    for (int k = 0; k < kRows / 2; ++k) {
      if (k >= half) continue;
      const State send = upper ? state[k] : state[k + half];
      State keep = upper ? state[k + half] : state[k];
      keep.merge(shuffle_xor(send, half));
      state[k] = keep;
    }
  }
  State total = state[0];
#pragma unroll
  for (int offset = kRows; offset < 32; offset *= 2) total.merge(shuffle_xor(total, offset));
  return total;
}

// Online row LSE of each of the CTA's kRows rows over its columns, exact column LSE over its
// rows, and the positives. Two exponentials per logit; the chunk is read once.
template <int kRows, bool kIds = false>
__global__ void __launch_bounds__(kThreads, kForwardMinCtasPerSm<kRows>) chunk_forward_kernel(ForwardChunkParams p) {
  __shared__ Lse warp_rows[kWarps][kRows];
  __shared__ int64_t row_id[kRows];
  const int64_t i0 = static_cast<int64_t>(blockIdx.y) * kRows;
  const int rows = static_cast<int>(p.M - i0 < kRows ? p.M - i0 : kRows);
  const float scale = *p.scale;
  if constexpr (kIds) {
    if (threadIdx.x < rows) row_id[threadIdx.x] = p.row_ids[i0 + threadIdx.x];
    __syncthreads();
  }
  Lse row_state[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) row_state[r] = Lse::empty();

  for (int64_t j0 = static_cast<int64_t>(blockIdx.x) * kThreads; j0 < p.width;
       j0 += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int64_t j = j0 + threadIdx.x;
    if (j >= p.width) continue;
    const float* column = p.dots + i0 * p.width + j;
    const int64_t pos_row = p.begin + j - p.pos_offset - i0;  // the row whose positive is column j
    const int64_t col_id = kIds ? p.col_ids[p.begin + j] : 0;
    Lse col_state = Lse::empty();
#pragma unroll
    for (int r = 0; r < kRows; ++r) {  // fully unrolled: row_state stays in registers
      if (r < rows) {
        const float x = scale * column[r * p.width];
        if (!kIds || row_id[r] != col_id || pos_row == r) {  // else excluded: same id, not the positive
          row_state[r].add(x);
          col_state.add(x);
        }
        if (pos_row == r) p.pos_logit[i0 + r] = x;
      }
    }
    if (p.col_partial != nullptr) p.col_partial[blockIdx.y * p.width + j] = col_state;
  }

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const Lse warp_total = warp_reduce_rows<kRows>(row_state);  // every lane takes part in the shuffles
  if (lane < kRows) warp_rows[warp][lane] = warp_total;
  __syncthreads();
  if (warp == 0 && lane < rows) {
    Lse total = warp_rows[0][lane];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) total.merge(warp_rows[w][lane]);
    p.row_partial[blockIdx.x * p.M + i0 + lane] = total;
  }
}

// running[i] merges the chunk's n_splits partial states of row i, in split order; on the last
// chunk (row_lse != nullptr) it also writes row_lse[i]. (The two merge kernels are static: this
// header is included by the contrastive and the distillation .cu files, one definition each.)
static __global__ void __launch_bounds__(kThreads)
    merge_row_partials_kernel(Lse* running, const Lse* row_partial, int64_t M, int n_splits, float* row_lse) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= M) return;
  Lse state = running[i];
  for (int x = 0; x < n_splits; ++x) state.merge(row_partial[x * M + i]);
  running[i] = state;
  if (row_lse != nullptr) row_lse[i] = state.value();
}

// col_lse[begin + j] from the chunk's n_blocks row-block states of column j, in block order.
static __global__ void __launch_bounds__(kThreads)
    merge_col_partials_kernel(const Lse* col_partial, int64_t width, int n_blocks, int64_t begin, float* col_lse) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (j >= width) return;
  Lse state = Lse::empty();
  for (int y = 0; y < n_blocks; ++y) state.merge(col_partial[y * width + j]);
  col_lse[begin + j] = state.value();
}

// Sum of v over the CTA in a fixed order; valid in thread 0.
__device__ __forceinline__ float cta_sum(float v, float* scratch) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  __syncthreads();
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
  __syncthreads();
  float total = 0.f;
  if (threadIdx.x == 0)
    for (int w = 0; w < kWarps; ++w) total += scratch[w];
  return total;
}

// dlogits = prescale * scale * dS for the chunk, and per-CTA sums of dS * dot and dS.
// With kIds, dS = 0 at the excluded pairs.
template <typename T, bool kIds = false>
__global__ void __launch_bounds__(kThreads) chunk_grad_kernel(GradChunkParams<T> p) {
  __shared__ float row_lse[kRowsPerCta], g_row[kRowsPerCta], g_pos[kRowsPerCta];
  __shared__ int64_t row_id[kRowsPerCta];
  __shared__ float scratch[kWarps];
  const int64_t i0 = static_cast<int64_t>(blockIdx.y) * kRowsPerCta;
  const int rows = static_cast<int>(p.M - i0 < kRowsPerCta ? p.M - i0 : kRowsPerCta);
  if (threadIdx.x < rows) {
    row_lse[threadIdx.x] = p.row_lse[i0 + threadIdx.x];
    g_row[threadIdx.x] = p.g_row[i0 + threadIdx.x];
    g_pos[threadIdx.x] = p.g_pos[i0 + threadIdx.x];
    if constexpr (kIds) row_id[threadIdx.x] = p.row_ids[i0 + threadIdx.x];
  }
  __syncthreads();
  const float scale = *p.scale;
  const float scale_out = scale * (p.prescale != nullptr ? *p.prescale : 1.f);
  float sum_dot = 0.f, sum = 0.f;

  for (int64_t j0 = static_cast<int64_t>(blockIdx.x) * kThreads; j0 < p.width;
       j0 += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int64_t j = j0 + threadIdx.x;
    if (j >= p.width) continue;
    const float g_col = p.g_col != nullptr ? p.g_col[p.begin + j] : 0.f;
    const float col_lse = p.g_col != nullptr ? p.col_lse[p.begin + j] : 0.f;
    const int64_t pos_row = p.begin + j - p.pos_offset - i0;
    const int64_t col_id = kIds ? p.col_ids[p.begin + j] : 0;
    const float* column = p.dots + i0 * p.width + j;
    T* out = p.dlogits + i0 * p.width + j;
#pragma unroll 8
    for (int r = 0; r < kRowsPerCta; ++r) {
      if (r >= rows) break;
      const float dot = column[r * p.width];
      const bool positive = pos_row == r;
      const bool kept = !kIds || row_id[r] != col_id || positive;
      const float ds = kept ? softmax_dlogit(scale * dot, g_row[r], row_lse[r], g_col, col_lse,
                                             positive ? g_pos[r] : 0.f, positive)
                            : 0.f;
      out[r * p.width] = static_cast<T>(scale_out * ds);
      sum_dot = fmaf(ds, dot, sum_dot);
      sum += ds;
    }
  }
  const float cta_dot = cta_sum(sum_dot, scratch);
  const float cta_plain = cta_sum(sum, scratch);
  if (threadIdx.x == 0) {
    const int64_t slot = static_cast<int64_t>(blockIdx.y) * gridDim.x + blockIdx.x;
    p.partial_scale[slot] = cta_dot;
    p.partial_bias[slot] = cta_plain;
  }
}

}  // namespace chunked_cuda
}  // namespace clipshard
