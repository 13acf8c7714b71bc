// The host launch logic of the distillation kernels (docs/distillation_cuda.md), torch-free:
// grids, teacher groups per forward launch, the pointer offsets of each launch and merge, all on
// plain pointers. csrc/cuda/distill_lse.cu calls it with a launcher that runs kernel<<<...>>> on
// the current stream; tests/cuda_emulation/emulate_distill.cpp with one that runs the kernels on
// the host. A launcher is called as launch(kernel, dim3 grid, args...), kThreads threads per CTA.
#pragma once

#include <cstdint>
#include "clipshard/launch_rules.h"
#include "distill_lse_kernels.cuh"

namespace clipshard {
namespace distill_cuda {

// The sizes that fix every launch of one op call.
struct LaunchShape {
  int64_t M, K, T;        // rows, columns, teachers
  int64_t pos_offset;     // row i's positive is column pos_offset + i
  bool want_columns;      // column statistics wanted
  int64_t sms;            // the device's multiprocessors (column splits)
  int64_t max_grid_rows;  // launch_rules::kMaxGridY on a GPU (the kernels loop past it)
};

inline unsigned forward_grid_rows(const LaunchShape& s) {
  return launch_rules::looping_grid_rows(s.M, kForwardRows, s.max_grid_rows);
}
inline unsigned forward_column_splits(const LaunchShape& s, int64_t width) {
  return launch_rules::chunk_column_splits(width, forward_grid_rows(s), s.sms, kThreads);
}
// Teachers that one forward launch folds together: its buffers of teacher states hold this many.
inline int64_t forward_launch_teachers(const LaunchShape& s) { return launch_rules::distill_launch_teachers(s.T, 0); }

// The forward's device buffers (fp32; online states as distill_lse_kernels.cuh lays them out).
struct ForwardBuffers {
  const float* student_dots;   // this chunk: M x width
  const float* teacher_dots;   // this chunk, per teacher: M x width, teacher_stride apart
  int64_t teacher_stride;
  const float* scale;          // device scalar
  const float* teacher_scale;  // [T]
  Lse* running;                // [M]: the student's row states across chunks
  Stat* teacher_running;       // [T][M]
  Lse* row_partial;            // [forward_column_splits(kc)][M]
  Stat* teacher_row_partial;   // [forward_launch_teachers][forward_column_splits(kc)][M]
  Lse* col_partial;            // [row blocks][kc], or nullptr without want_columns
  Stat* teacher_col_partial;   // [forward_launch_teachers][row blocks][kc], or nullptr
  float *row_lse, *pos_logit;  // [M]
  float *teacher_row_lse, *row_cross;  // [T][M]
  float *col_lse;                      // [K], or nullptr without want_columns
  float *teacher_col_lse, *col_cross;  // [T][K], or nullptr
};

// One chunk of columns [begin, begin + width) of the forward, whose student dots are in place:
// teachers kMaxLaunchTeachers per launch (teacher_gemm(t) first writes teacher t's dots), the first
// launch also folding the student's own statistics, then the merges of each launch's partials.
template <typename TeacherGemm, typename Launch>
void forward_chunk(const LaunchShape& s, const ForwardBuffers& b, int64_t begin, int64_t width,
                   TeacherGemm&& teacher_gemm, Launch&& launch) {
  const int64_t M = s.M, n_blocks = row_blocks_of(M, kForwardRows);
  const bool last = begin + width == s.K;
  const unsigned gx = forward_column_splits(s, width), gy = forward_grid_rows(s);
  const dim3 grid{gx, gy, 1};
  const dim3 row_grid{static_cast<unsigned>(launch_rules::ceil_div(M, kThreads)), 1, 1};
  const dim3 col_grid{static_cast<unsigned>(launch_rules::ceil_div(width, kThreads)), 1, 1};
  for (int64_t t0 = 0; t0 < s.T; t0 += kMaxLaunchTeachers) {
    const int64_t n = launch_rules::distill_launch_teachers(s.T, t0);  // the first-use check queries this rule too
    for (int64_t t = t0; t < t0 + n; ++t) teacher_gemm(t);
    const bool student = t0 == 0;
    const ForwardParams p{b.student_dots, b.teacher_dots + t0 * b.teacher_stride, b.teacher_stride, M, width, begin,
                          b.scale, b.teacher_scale + t0, s.pos_offset, student ? b.row_partial : nullptr,
                          b.teacher_row_partial, student && s.want_columns ? b.col_partial : nullptr,
                          s.want_columns ? b.teacher_col_partial : nullptr, b.pos_logit};
    if (n == 2)
      launch(distill_forward_kernel<2>, grid, p);
    else
      launch(distill_forward_kernel<1>, grid, p);
    if (student) {
      launch(chunked_cuda::merge_row_partials_kernel, row_grid, b.running, static_cast<const Lse*>(b.row_partial), M,
             static_cast<int>(gx), last ? b.row_lse : nullptr);
      if (s.want_columns)
        launch(chunked_cuda::merge_col_partials_kernel, col_grid, static_cast<const Lse*>(b.col_partial), width,
               static_cast<int>(n_blocks), begin, b.col_lse);
    }
    for (int64_t q = 0; q < n; ++q) {
      const int64_t t = t0 + q;
      launch(merge_teacher_row_partials_kernel, row_grid, b.teacher_running + t * M,
             static_cast<const Stat*>(b.teacher_row_partial + q * gx * M), M, static_cast<int>(gx),
             last ? b.teacher_row_lse + t * M : nullptr, last ? b.row_cross + t * M : nullptr);
      if (s.want_columns)
        launch(merge_teacher_col_partials_kernel, col_grid,
               static_cast<const Stat*>(b.teacher_col_partial + q * n_blocks * width), width,
               static_cast<int>(n_blocks), begin, b.teacher_col_lse + t * s.K, b.col_cross + t * s.K);
    }
  }
}

// The gradient kernel's launch over one chunk (p filled for it): column splits and the looping grid.
template <typename TS, typename TT, typename Launch>
void grad_chunk(const LaunchShape& s, const GradParams<TS, TT>& p, Launch&& launch) {
  const unsigned gy = launch_rules::looping_grid_rows(s.M, kGradRows, s.max_grid_rows);
  launch(distill_grad_kernel<TS, TT>, dim3{launch_rules::chunk_column_splits(p.width, gy, s.sms, kThreads), gy, 1}, p);
}

}  // namespace distill_cuda
}  // namespace clipshard
