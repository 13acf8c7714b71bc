// The per-chunk elementwise kernel of the chunked SigLIP loss on CUDA (docs/siglip.md). Torch-free:
// it sees plain pointers and sizes; csrc/cuda/siglip.cu is the only file that touches tensors, and
// the chunk driver (csrc/chunked/chunk_driver.h) runs the GEMMs around it.
//
// One CTA per row of the chunk: its threads stride over the row's columns, read each raw
// similarity once, form l = scale * dot + bias and the loss term (and, in the gradient pass, write
// the logit gradient scale * dl times a power-of-two prescale in the dlogits dtype, and the partial
// sums of dl * dot and dl); a fixed-shape tree reduction gives the row's sums, which thread 0 adds
// to the row's own accumulators. Chunks run in order on one stream and every row has one owner, so
// there are no atomics and the result is deterministic.
#pragma once

#include <cstdint>

#include "clipshard/launch_rules.h"
#include "clipshard/siglip_math.h"

namespace clipshard {
namespace siglip_cuda {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

template <typename DL>
struct ChunkParams {
  const float* dots;  // rows x width, contiguous: raw similarities of columns [begin, begin + width)
  DL* dlogits;        // rows x width, or nullptr in the loss-only pass
  int64_t rows, width, begin, pos_offset;  // row i's positive is global column pos_offset + i (none: kNoPositives)
  const float* scale;     // device scalar
  const float* bias;      // device scalar, or nullptr for no bias
  const float* prescale;  // device scalar multiplying the written gradients, or nullptr for 1
  double* row_loss;        // rows: this chunk's loss terms are added here
  double* row_grad_scale;  // rows: sum of dl * dot (gradient pass only)
  double* row_grad_bias;   // rows: sum of dl (gradient pass only)
};

// Sum over the CTA of each thread's v[0..N); the result is valid in thread 0. Same order for every
// launch: butterfly within each warp, then warp 0 adds the warps in order.
template <int N>
__device__ __forceinline__ void block_sum(float (&v)[N]) {
  __shared__ float warp_sums[N][kWarps];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
  for (int k = 0; k < N; ++k) {
    for (int offset = 16; offset > 0; offset /= 2) v[k] += __shfl_xor_sync(0xffffffffu, v[k], offset);
  }
  if (lane == 0) {
#pragma unroll
    for (int k = 0; k < N; ++k) warp_sums[k][warp] = v[k];
  }
  __syncthreads();
  if (threadIdx.x == 0) {
#pragma unroll
    for (int k = 0; k < N; ++k) {
      float total = 0.0f;
      for (int w = 0; w < kWarps; ++w) total += warp_sums[k][w];
      v[k] = total;
    }
  }
}

template <typename DL, bool kGrad>
__global__ void __launch_bounds__(kThreads) siglip_chunk_kernel(ChunkParams<DL> p) {
  const int64_t i = blockIdx.x;
  const float s = *p.scale, b = p.bias ? *p.bias : 0.0f;
  const float gain = s * (p.prescale ? *p.prescale : 1.0f);  // d loss / d dot, prescaled
  const float* dots = p.dots + i * p.width;
  const int64_t pos = p.pos_offset + i - p.begin;  // the positive's column in this chunk (maybe outside)
  float sums[3] = {0.0f, 0.0f, 0.0f};             // loss, dl * dot, dl
  for (int64_t j = threadIdx.x; j < p.width; j += kThreads) {
    const float dot = dots[j];
    const float z = j == pos ? 1.0f : -1.0f;
    if constexpr (kGrad) {
      float value, dl;
      siglip_term(s * dot + b, z, value, dl);
      p.dlogits[i * p.width + j] = DL(gain * dl);
      sums[0] += value;
      sums[1] += dl * dot;
      sums[2] += dl;
    } else {
      sums[0] += siglip_softplus(s * dot + b, z);
    }
  }
  block_sum(sums);
  if (threadIdx.x == 0) {
    p.row_loss[i] += sums[0];
    if constexpr (kGrad) {
      p.row_grad_scale[i] += sums[1];
      p.row_grad_bias[i] += sums[2];
    }
  }
}

// Labels by sample id (siglip_forward's row_ids / col_ids): the chunk's parameters plus the ids.
template <typename DL>
struct IdChunkParams {
  ChunkParams<DL> chunk;
  const int64_t* row_ids;  // rows: the chunk's rows' ids
  const int64_t* col_ids;  // columns [begin, begin + width) of the chunk start at col_ids + begin
  bool mask_same_ids;      // true: a same-id pair other than the positive has no term; false: z = +1
  int rows_per_cta;        // 1 .. kIdRows
};

// The most rows per CTA of the kernel with ids: each thread loads a column's id once for all of them.
constexpr int kIdRows = launch_rules::kSiglipMaxIdRows;

// The kernel above with labels by id, for rows_per_cta rows per CTA: z_ij = +1 for the positive
// and for row_ids[i] == col_ids[j] (or no term at all with mask_same_ids), else -1. Each thread
// reads the ids of the CTA's rows once (broadcast loads) and the id of each of its columns once,
// then does what the kernel above does for each row; every row's partial sums are formed in the
// same order as there (whatever rows_per_cta), so ids that match only at the positives give the
// same bits.
template <typename DL, bool kGrad>
__global__ void __launch_bounds__(kThreads) siglip_ids_chunk_kernel(IdChunkParams<DL> q) {
  const ChunkParams<DL>& p = q.chunk;
  const int64_t first = int64_t(blockIdx.x) * q.rows_per_cta;
  const int rows = p.rows - first < q.rows_per_cta ? static_cast<int>(p.rows - first) : q.rows_per_cta;
  const float s = *p.scale, b = p.bias ? *p.bias : 0.0f;
  const float gain = s * (p.prescale ? *p.prescale : 1.0f);  // d loss / d dot, prescaled
  const int64_t pos0 = p.pos_offset + first - p.begin;       // row first + r's positive: column pos0 + r
  int64_t row_id[kIdRows];
#pragma unroll
  for (int r = 0; r < kIdRows; ++r) row_id[r] = r < rows ? q.row_ids[first + r] : 0;
  float sums[3 * kIdRows];  // per row: loss, dl * dot, dl
#pragma unroll
  for (int k = 0; k < 3 * kIdRows; ++k) sums[k] = 0.0f;
  for (int64_t j = threadIdx.x; j < p.width; j += kThreads) {
    const int64_t col_id = q.col_ids[p.begin + j];
#pragma unroll
    for (int r = 0; r < kIdRows; ++r) {
      if (r >= rows) break;
      const int64_t at = (first + r) * p.width + j;
      const float dot = p.dots[at];
      const bool positive = j - r == pos0, same = col_id == row_id[r];
      const bool dropped = same && !positive && q.mask_same_ids;  // no term: adds zeros below
      const float z = positive || same ? 1.0f : -1.0f;
      if constexpr (kGrad) {
        float value, dl;
        siglip_term(s * dot + b, z, value, dl);
        value = dropped ? 0.0f : value;
        dl = dropped ? 0.0f : dl;
        p.dlogits[at] = DL(gain * dl);
        sums[3 * r] += value;
        sums[3 * r + 1] += dropped ? 0.0f : dl * dot;  // not 0 * dot: an Inf or NaN dot there leaves no trace
        sums[3 * r + 2] += dl;
      } else {
        const float value = siglip_softplus(s * dot + b, z);
        sums[3 * r] += dropped ? 0.0f : value;
      }
    }
  }
  block_sum(sums);
  if (threadIdx.x == 0) {
#pragma unroll
    for (int r = 0; r < kIdRows; ++r) {  // unrolled, so that sums stays in registers
      if (r >= rows) break;
      p.row_loss[first + r] += sums[3 * r];
      if constexpr (kGrad) {
        p.row_grad_scale[first + r] += sums[3 * r + 1];
        p.row_grad_bias[first + r] += sums[3 * r + 2];
      }
    }
  }
}

}  // namespace siglip_cuda
}  // namespace clipshard
