// Fused elementwise kernels of the chunked distillation op on CUDA (docs/distillation_cuda.md). The
// GEMMs have already written one chunk of raw similarities (fp32, row-major, M x width): the
// student's rows @ cols[begin : begin + width]^T and each teacher's likewise; these kernels read each
// chunk once. Torch-free: plain pointers and sizes (tests/cuda_emulation runs them on the host).
//
// Geometry (that of contrastive_lse_chunked_kernels.cuh): a CTA of kThreads threads owns the row
// blocks blockIdx.y, blockIdx.y + gridDim.y, ... (one unless M needs more than 65535) and the
// column steps blockIdx.x, blockIdx.x + gridDim.x, ... of kThreads columns each; a thread owns one
// column of each step, so every warp load reads 128 consecutive bytes.
#pragma once

#include <cstdint>

#include "clipshard/launch_rules.h"
#include "clipshard/online_distill.h"
#include "contrastive_lse_chunked_kernels.cuh"

namespace clipshard {

// A lane exchange of an OnlineSoftmaxMean state, for chunked_cuda::warp_reduce_rows (found by
// argument-dependent lookup, hence in this namespace).
__device__ __forceinline__ OnlineSoftmaxMean<float> shuffle_xor(const OnlineSoftmaxMean<float>& s, int lane_mask) {
  return {__shfl_xor_sync(0xffffffffu, s.max, lane_mask), __shfl_xor_sync(0xffffffffu, s.sum, lane_mask),
          __shfl_xor_sync(0xffffffffu, s.weighted, lane_mask)};
}

namespace distill_cuda {

using chunked_cuda::kThreads;
using chunked_cuda::kWarps;
using chunked_cuda::Lse;
using Stat = OnlineSoftmaxMean<float>;

// Rows per CTA of the forward kernel: 16 rows x (2 + 3 kTeachers) floats of row state per thread.
constexpr int kForwardRows = 16;
// Rows per CTA of the gradient kernel: 2 x 16 floats per thread (the rows' s and dS of a column).
// 32 rows needed 208-212 registers on sm_100 (one CTA per SM) and spilled on sm_120 (docs).
constexpr int kGradRows = 16;
// CTAs per SM that __launch_bounds__ asks ptxas to fit (docs/distillation_cuda.md, "Resources"):
// the gradient kernel and the one-teacher forward two, the teacher-pair forward one.
constexpr int kGradMinCtasPerSm = 2;
template <int kTeachers>
constexpr int kForwardMinCtasPerSm = kTeachers == 1 ? 2 : 1;
// The teacher-pair launch keeps the student's 16 row states in shared memory instead of registers
// (32 registers fewer: 255 registers and a spill on sm_100 before), one Lse per row and thread.
template <int kTeachers>
constexpr bool kStudentRowsInShared = kTeachers == 2;
// Teachers folded by one forward launch at most: each launch reads the student's chunk once, so
// T teachers cost ceil(T / 2) reads of it instead of T (launch_rules.h's distill_launch_teachers).
constexpr int kMaxLaunchTeachers = launch_rules::kDistillMaxLaunchTeachers;

// One launch folds kTeachers (1 or 2) teachers' chunks and, when student_row_partial is set (the
// first launch), the student's own statistics.
struct ForwardParams {
  const float* student;        // M x width dots
  const float* teachers;       // this launch's teachers' M x width dots, teacher_stride apart
  int64_t teacher_stride;
  int64_t M, width, begin;
  const float* scale;          // device scalar
  const float* teacher_scale;  // device scalars of this launch's teachers (consecutive)
  int64_t pos_offset;          // row i's positive is global column pos_offset + i
  Lse* student_row_partial;    // [gridDim.x][M]: each column split's state of each row, or nullptr
  Stat* teacher_row_partial;   // per teacher [gridDim.x][M], gridDim.x * M apart
  Lse* student_col_partial;    // [row blocks][width]: each row block's state of each column, or nullptr
  Stat* teacher_col_partial;   // per teacher [row blocks][width], row blocks * width apart, or nullptr
  float* pos_logit;            // [M], written in the student's launch by the CTA holding the positive
};

CLIPSHARD_HOST_DEVICE int64_t row_blocks_of(int64_t M, int rows_per_cta) {
  return (M + rows_per_cta - 1) / rows_per_cta;
}

// out[r] = the CTA's total of row r's states (r < rows): each warp's rows reduced across its lanes
// (chunked_cuda::warp_reduce_rows), then warp 0 merges the warps in order. Every thread of the CTA
// must call it; scratch may be reused after the next __syncthreads.
template <typename State>
__device__ __forceinline__ void write_row_totals(State (&state)[kForwardRows], State* out, int rows,
                                                 State (*scratch)[kForwardRows]) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const State warp_total = chunked_cuda::warp_reduce_rows<kForwardRows, State>(state);
  if (lane < kForwardRows) scratch[warp][lane] = warp_total;
  __syncthreads();
  if (warp == 0 && lane < rows) {
    State total = scratch[0][lane];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) total.merge(scratch[w][lane]);
    out[lane] = total;
  }
}

// Per CTA and row block: the online row statistics of its rows over its columns, and the exact
// column statistics of its columns over its rows. One exponential per logit and statistic; each
// student logit is read once per launch, for all of the launch's teachers.
template <int kTeachers>
__global__ void __launch_bounds__(kThreads, kForwardMinCtasPerSm<kTeachers>) distill_forward_kernel(ForwardParams p) {
  static_assert(kTeachers >= 1 && kTeachers <= kMaxLaunchTeachers, "1 or 2 teachers per launch");
  constexpr bool kSharedRows = kStudentRowsInShared<kTeachers>;
  __shared__ Lse student_scratch[kWarps][kForwardRows];
  __shared__ Stat teacher_scratch[kTeachers][kWarps][kForwardRows];
  // [row][thread]: consecutive threads read consecutive states (no bank conflicts); one element
  // when unused, so that the one-teacher kernel keeps its small footprint.
  __shared__ Lse student_rows_shared[kSharedRows ? kForwardRows : 1][kSharedRows ? kThreads : 1];
  const int64_t n_blocks = row_blocks_of(p.M, kForwardRows);
  const float scale = *p.scale;
  float teacher_scale[kTeachers];
#pragma unroll
  for (int q = 0; q < kTeachers; ++q) teacher_scale[q] = p.teacher_scale[q];
  const bool with_student = p.student_row_partial != nullptr;  // uniform over the grid

  for (int64_t block = blockIdx.y; block < n_blocks; block += gridDim.y) {
    const int64_t i0 = block * kForwardRows;
    const int rows = static_cast<int>(p.M - i0 < kForwardRows ? p.M - i0 : kForwardRows);
    Lse student_row[kSharedRows ? 1 : kForwardRows];
    Stat teacher_row[kTeachers][kForwardRows];
#pragma unroll
    for (int r = 0; r < kForwardRows; ++r) {
      if constexpr (kSharedRows)
        student_rows_shared[r][threadIdx.x] = Lse::empty();
      else
        student_row[r] = Lse::empty();
#pragma unroll
      for (int q = 0; q < kTeachers; ++q) teacher_row[q][r] = Stat::empty();
    }

    for (int64_t j0 = static_cast<int64_t>(blockIdx.x) * kThreads; j0 < p.width;
         j0 += static_cast<int64_t>(gridDim.x) * kThreads) {
      const int64_t j = j0 + threadIdx.x;
      if (j >= p.width) continue;
      const float* s_column = p.student + i0 * p.width + j;
      const float* t_column = p.teachers + i0 * p.width + j;
      const int64_t pos_row = p.begin + j - p.pos_offset - i0;  // the row whose positive is column j
      Lse student_col = Lse::empty();
      Stat teacher_col[kTeachers];
#pragma unroll
      for (int q = 0; q < kTeachers; ++q) teacher_col[q] = Stat::empty();
#pragma unroll
      for (int r = 0; r < kForwardRows; ++r) {  // fully unrolled: the row states stay in registers
        if (r < rows) {
          const float s = scale * s_column[r * p.width];
#pragma unroll
          for (int q = 0; q < kTeachers; ++q) {
            const float t = teacher_scale[q] * t_column[q * p.teacher_stride + r * p.width];
            teacher_row[q][r].add(t, s);
            teacher_col[q].add(t, s);
          }
          if (with_student) {
            if constexpr (kSharedRows)  // each thread touches only its own column of the array
              student_rows_shared[r][threadIdx.x].add(s);
            else
              student_row[r].add(s);
            student_col.add(s);
            if (pos_row == r) p.pos_logit[i0 + r] = s;
          }
        }
      }
      if (p.teacher_col_partial != nullptr) {
#pragma unroll
        for (int q = 0; q < kTeachers; ++q)
          p.teacher_col_partial[(q * n_blocks + block) * p.width + j] = teacher_col[q];
      }
      if (p.student_col_partial != nullptr) p.student_col_partial[block * p.width + j] = student_col;
    }
#pragma unroll
    for (int q = 0; q < kTeachers; ++q)
      write_row_totals(teacher_row[q], p.teacher_row_partial + (q * gridDim.x + blockIdx.x) * p.M + i0, rows,
                       teacher_scratch[q]);
    if (with_student) {
      if constexpr (kSharedRows) {
        Lse from_shared[kForwardRows];  // the teachers' row states are dead here
#pragma unroll
        for (int r = 0; r < kForwardRows; ++r) from_shared[r] = student_rows_shared[r][threadIdx.x];
        write_row_totals(from_shared, p.student_row_partial + blockIdx.x * p.M + i0, rows, student_scratch);
      } else {
        write_row_totals(student_row, p.student_row_partial + blockIdx.x * p.M + i0, rows, student_scratch);
      }
    }
    __syncthreads();  // the next row block writes the scratch again
  }
}

// running[i] merges the chunk's n_splits partial states of teacher row i, in split order; on the
// last chunk (lse != nullptr) it also writes the row's lse and cross (softmax-weighted mean).
__global__ void __launch_bounds__(kThreads) merge_teacher_row_partials_kernel(Stat* running, const Stat* row_partial,
                                                                              int64_t M, int n_splits, float* lse,
                                                                              float* cross) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= M) return;
  Stat state = running[i];
  for (int x = 0; x < n_splits; ++x) state.merge(row_partial[x * M + i]);
  running[i] = state;
  if (lse != nullptr) {
    lse[i] = state.lse();
    cross[i] = state.mean();
  }
}

// lse[begin + j] and cross[begin + j] of teacher column j from the chunk's n_blocks row-block
// states, in block order.
__global__ void __launch_bounds__(kThreads) merge_teacher_col_partials_kernel(const Stat* col_partial, int64_t width,
                                                                              int n_blocks, int64_t begin, float* lse,
                                                                              float* cross) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (j >= width) return;
  Stat state = Stat::empty();
  for (int y = 0; y < n_blocks; ++y) state.merge(col_partial[y * width + j]);
  lse[begin + j] = state.lse();
  cross[begin + j] = state.mean();
}

// The gradient kernel's inputs: vectors are nullptr where the upstream gradient is absent (or the
// statistic not needed); teacher vectors are [n_teachers][M] or [n_teachers][K] (global columns).
template <typename TS, typename TT>
struct GradParams {
  const float* student;   // M x width dots
  const float* teachers;  // [n_teachers] chunks of M x width dots, teacher_stride apart
  int64_t M, K, width, begin, n_teachers;  // n_teachers = 0: no teacher term reaches dS or dT
  int64_t teacher_stride;  // elements from one teacher's chunk (dots or dT) to the next's
  const float* scale;
  const float* teacher_scale;  // [n_teachers]
  const float* prescale;       // [1 + n_teachers][2]: power-of-two prescale of dS, then of each dT^k; or nullptr
  int64_t pos_offset;
  const float *g_row_lse, *row_lse, *g_pos, *g_col_lse, *col_lse;
  const float *g_teacher_row_lse, *g_row_cross, *teacher_row_lse, *row_cross;
  const float *g_teacher_col_lse, *g_col_cross, *teacher_col_lse, *col_cross;
  TS* ds;  // M x width: prescale * dS (no logit scale)
  TT* dt;  // [n_teachers] chunks of M x width, teacher_stride apart: prescale_k * dT^k, or nullptr
};

__device__ __forceinline__ float value_or_zero(const float* v, int64_t i) { return v != nullptr ? v[i] : 0.f; }

// dS and every dT^k of the chunk, one column per thread and its kGradRows rows at a time: the
// student's own softmax terms (softmax_dlogit) plus each teacher's (teacher_dlogits), the formulas
// of clipshard/online_distill.h. The rows' s and dS stay in registers while the teachers' terms are
// added, so each student logit and each column's teacher statistics are read once per CTA (the
// rows' statistics are the same for every thread: broadcast loads).
template <typename TS, typename TT>
__global__ void __launch_bounds__(kThreads, kGradMinCtasPerSm) distill_grad_kernel(GradParams<TS, TT> p) {
  const int64_t n_blocks = row_blocks_of(p.M, kGradRows);
  const float scale = *p.scale;
  const float ds_prescale = p.prescale != nullptr ? p.prescale[0] : 1.f;
  const bool want_dt = p.dt != nullptr;

  for (int64_t block = blockIdx.y; block < n_blocks; block += gridDim.y) {
    const int64_t i0 = block * kGradRows;
    const int rows = static_cast<int>(p.M - i0 < kGradRows ? p.M - i0 : kGradRows);
    for (int64_t j0 = static_cast<int64_t>(blockIdx.x) * kThreads; j0 < p.width;
         j0 += static_cast<int64_t>(gridDim.x) * kThreads) {
      const int64_t j = j0 + threadIdx.x;
      if (j >= p.width) continue;
      const int64_t col = p.begin + j;
      const float g_col = value_or_zero(p.g_col_lse, col), c_lse = value_or_zero(p.col_lse, col);
      const int64_t pos_row = col - p.pos_offset - i0;
      float s[kGradRows], ds[kGradRows];
#pragma unroll
      for (int r = 0; r < kGradRows; ++r) {
        if (r < rows) {
          const int64_t i = i0 + r;
          s[r] = scale * p.student[i * p.width + j];
          const bool positive = pos_row == r;
          ds[r] = softmax_dlogit(s[r], value_or_zero(p.g_row_lse, i), value_or_zero(p.row_lse, i), g_col, c_lse,
                                 positive ? value_or_zero(p.g_pos, i) : 0.f, positive);
        }
      }
      for (int64_t k = 0; k < p.n_teachers; ++k) {
        const int64_t kj = k * p.K + col;
        const TeacherSide<float> col_side{value_or_zero(p.teacher_col_lse, kj), value_or_zero(p.col_cross, kj),
                                          value_or_zero(p.g_teacher_col_lse, kj), value_or_zero(p.g_col_cross, kj)};
        const float t_scale = p.teacher_scale[k];
        const float dt_prescale = p.prescale != nullptr ? p.prescale[2 * (1 + k)] : 1.f;
        const float* t_column = p.teachers + k * p.teacher_stride + j;
#pragma unroll
        for (int r = 0; r < kGradRows; ++r) {
          if (r < rows) {
            const int64_t ki = k * p.M + i0 + r, at = (i0 + r) * p.width;
            const TeacherSide<float> row_side{value_or_zero(p.teacher_row_lse, ki), value_or_zero(p.row_cross, ki),
                                              value_or_zero(p.g_teacher_row_lse, ki), value_or_zero(p.g_row_cross, ki)};
            const float dt = teacher_dlogits(s[r], t_scale * t_column[at], row_side, col_side, want_dt, ds[r]);
            if (want_dt) p.dt[k * p.teacher_stride + at + j] = static_cast<TT>(dt * dt_prescale);
          }
        }
      }
#pragma unroll
      for (int r = 0; r < kGradRows; ++r)
        if (r < rows) p.ds[(i0 + r) * p.width + j] = static_cast<TS>(ds[r] * ds_prescale);
    }
  }
}

}  // namespace distill_cuda
}  // namespace clipshard
