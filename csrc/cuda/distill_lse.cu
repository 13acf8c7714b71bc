// CUDA registration of distill_lse / distill_lse_backward: the chunked path (docs/distillation_cuda.md).
// Per chunk of columns, cuBLAS GEMMs (through ATen; fp32 output for 16-bit features) write the
// student's and each teacher's raw similarities into a bounded fp32 workspace, then the fused
// kernels of distill_lse_kernels.cuh read them once: the forward's statistics, or the backward's
// dS and dT^k, whose gradient GEMMs the chunk driver's GradientAccumulator runs. Everything is on
// the current stream; nothing waits for the device.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

#include "../chunked/chunk_driver.h"
#include "../distill_args.h"
#include "clipshard/launch_config.h"
#include "dispatch_features.h"
#include "distill_lse_kernels.cuh"
#include "fp16_prescale.h"

namespace clipshard {
namespace {

using at::Tensor;
namespace k = distill_cuda;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

static_assert(k::kMaxLaunchTeachers == launch::kDistillMaxLaunchTeachers,
              "distill_forward_kernel<1> and <2> are launch_config.h's variants");

// The grid's y dimension for blocks of rows_per_cta rows: one CTA row per block up to 65535, then
// each CTA takes every gridDim.y-th block (the kernels loop), so that M has no limit.
unsigned grid_rows(int64_t M, int rows_per_cta) {
  return static_cast<unsigned>(std::min(k::row_blocks_of(M, rows_per_cta), k::kMaxGridRows));
}

// Column splits: about three CTAs per SM, each with as many column steps as possible.
unsigned column_splits(int64_t width, unsigned n_row_blocks) {
  const int64_t steps = ceil_div(width, k::kThreads);
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  return static_cast<unsigned>(std::clamp<int64_t>(ceil_div(3 * sms, n_row_blocks), 1, steps));
}

template <typename State>
State* as_states(const Tensor& t) {
  return reinterpret_cast<State*>(t.data_ptr<float>());
}

const float* ptr(const Tensor& t) { return t.defined() ? t.const_data_ptr<float>() : nullptr; }

// Empty online states (max = -inf, the rest 0), `floats` floats each.
Tensor empty_states(int64_t n, int64_t floats, const at::TensorOptions& f32) {
  Tensor t = at::zeros({n, floats}, f32);
  t.select(1, 0).fill_(-std::numeric_limits<float>::infinity());
  return t;
}

void check_cuda(const char* op, const Tensor& rows, const Tensor& cols, const Tensor& teacher_rows,
                const Tensor& teacher_cols, const Tensor& scale, const Tensor& teacher_scale, int64_t pos_offset,
                int64_t workspace_bytes) {
  TORCH_CHECK(rows.is_cuda(), op, ": rows must be on a CUDA device, got ", rows.device());
  check_distill_inputs(op, rows, cols, teacher_rows, teacher_cols, scale, teacher_scale, pos_offset,
                       /*allow_double=*/false);
  TORCH_CHECK(workspace_bytes > 0, op, ": workspace_bytes must be positive, got ", workspace_bytes);
}

// ---------------------------------------------------------------------------------------- forward

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> distill_lse_cuda(
    const Tensor& rows, const Tensor& cols, const Tensor& teacher_rows, const Tensor& teacher_cols,
    const Tensor& scale, const Tensor& teacher_scale, int64_t pos_offset, bool want_columns,
    int64_t workspace_bytes) {
  const char* op = "distill_lse";
  check_cuda(op, rows, cols, teacher_rows, teacher_cols, scale, teacher_scale, pos_offset, workspace_bytes);
  c10::cuda::CUDAGuard guard(rows.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int64_t M = rows.size(0), K = cols.size(0), T = teacher_rows.size(0);
  const auto f32 = rows.options().dtype(at::kFloat);
  const Tensor scale_f = scale.to(at::kFloat).reshape({}), teacher_scale_f = teacher_scale.to(at::kFloat).contiguous();
  // Workspace per logit: the student's and the teachers' fp32 chunks, plus the partial column
  // states of one launch (the student's and two teachers': (2 + 2 x 3) floats per 16 rows).
  const int64_t kc = chunked::chunk_columns(M, K, 4 * (1 + T) + 2, workspace_bytes);
  const int64_t n_blocks = k::row_blocks_of(M, k::kForwardRows);
  const unsigned gy = grid_rows(M, k::kForwardRows);
  const unsigned gx_max = column_splits(kc, gy);
  const int64_t pair = std::min<int64_t>(T, k::kMaxLaunchTeachers);
  const Tensor student_dots = at::empty({M * kc}, f32), teacher_dots = at::empty({T, M * kc}, f32);
  Tensor running = empty_states(M, 2, f32), teacher_running = empty_states(T * M, 3, f32);
  const Tensor row_partial = at::empty({int64_t(gx_max) * M * 2}, f32);
  const Tensor teacher_row_partial = at::empty({pair * gx_max * M * 3}, f32);
  const Tensor col_partial = want_columns ? at::empty({n_blocks * kc * 2}, f32) : Tensor();
  const Tensor teacher_col_partial = want_columns ? at::empty({pair * n_blocks * kc * 3}, f32) : Tensor();
  const int64_t Kc = want_columns ? K : 0;
  Tensor row_lse = at::empty({M}, f32), pos_logit = at::empty({M}, f32);
  Tensor teacher_row_lse = at::empty({T, M}, f32), row_cross = at::empty({T, M}, f32);
  Tensor col_lse = at::empty({Kc}, f32), teacher_col_lse = at::empty({T, Kc}, f32), col_cross = at::empty({T, Kc}, f32);

  for (int64_t begin = 0; begin < K; begin += kc) {
    const int64_t width = std::min(kc, K - begin);
    const bool last = begin + width == K;
    const unsigned gx = column_splits(width, gy);
    const unsigned row_grid = static_cast<unsigned>(ceil_div(M, k::kThreads));
    const unsigned col_grid = static_cast<unsigned>(ceil_div(width, k::kThreads));
    Tensor s = chunked::workspace_view(student_dots, M, width);
    chunked::mm_into(s, rows, cols.narrow(0, begin, width).t());
    // Teachers two per launch, so that the student's chunk is read ceil(T / 2) times.
    for (int64_t t0 = 0; t0 < T; t0 += k::kMaxLaunchTeachers) {
      const int n = launch::distill_launch_teachers(T, t0);  // the first-use check queries this rule too
      for (int64_t t = t0; t < t0 + n; ++t) {
        Tensor d = chunked::workspace_view(teacher_dots[t], M, width);
        chunked::mm_into(d, teacher_rows[t], teacher_cols[t].narrow(0, begin, width).t());
      }
      const bool student = t0 == 0;  // the first launch also folds the student's own statistics
      const k::ForwardParams p{s.const_data_ptr<float>(), teacher_dots[t0].const_data_ptr<float>(), M * kc, M, width,
                               begin, scale_f.const_data_ptr<float>(), teacher_scale_f.const_data_ptr<float>() + t0,
                               pos_offset, student ? as_states<k::Lse>(row_partial) : nullptr,
                               as_states<k::Stat>(teacher_row_partial),
                               student && want_columns ? as_states<k::Lse>(col_partial) : nullptr,
                               want_columns ? as_states<k::Stat>(teacher_col_partial) : nullptr,
                               pos_logit.mutable_data_ptr<float>()};
      if (n == 2)
        k::distill_forward_kernel<2><<<dim3(gx, gy), k::kThreads, 0, stream>>>(p);
      else
        k::distill_forward_kernel<1><<<dim3(gx, gy), k::kThreads, 0, stream>>>(p);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      if (student) {
        chunked_cuda::merge_row_partials_kernel<<<row_grid, k::kThreads, 0, stream>>>(
            as_states<k::Lse>(running), as_states<k::Lse>(row_partial), M, static_cast<int>(gx),
            last ? row_lse.mutable_data_ptr<float>() : nullptr);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        if (want_columns) {
          chunked_cuda::merge_col_partials_kernel<<<col_grid, k::kThreads, 0, stream>>>(
              as_states<k::Lse>(col_partial), width, static_cast<int>(n_blocks), begin,
              col_lse.mutable_data_ptr<float>());
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        }
      }
      for (int64_t q = 0; q < n; ++q) {
        const int64_t t = t0 + q;
        k::merge_teacher_row_partials_kernel<<<row_grid, k::kThreads, 0, stream>>>(
            as_states<k::Stat>(teacher_running) + t * M, as_states<k::Stat>(teacher_row_partial) + q * gx * M, M,
            static_cast<int>(gx), last ? teacher_row_lse[t].mutable_data_ptr<float>() : nullptr,
            last ? row_cross[t].mutable_data_ptr<float>() : nullptr);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        if (want_columns) {
          k::merge_teacher_col_partials_kernel<<<col_grid, k::kThreads, 0, stream>>>(
              as_states<k::Stat>(teacher_col_partial) + q * n_blocks * width, width, static_cast<int>(n_blocks),
              begin, teacher_col_lse[t].mutable_data_ptr<float>(), col_cross[t].mutable_data_ptr<float>());
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        }
      }
    }
  }
  return {row_lse, pos_logit, teacher_row_lse, row_cross, col_lse, teacher_col_lse, col_cross};
}

// --------------------------------------------------------------------------------------- backward

// |v| summed over the defined tensors (each of shape `like`), or zeros.
Tensor abs_sum(std::initializer_list<Tensor> parts, const Tensor& like) {
  Tensor total = at::zeros_like(like);
  for (const Tensor& p : parts)
    if (p.defined()) total.add_(p.abs());
  return total;
}

// The power-of-two prescales of fp16 dlogits (fp16_prescale.h), [1 + T][2]: for dS, bounded by
// sum of its upstream gradients' magnitudes (|row_lse'| + sum_k |row_cross_k'| per row, likewise
// per column, and the positive's), then for each dT^k, bounded by |teacher_row_lse'| +
// |row_cross'| W per row and likewise per column, with W = 2 |scale| max|rows_i| max|cols_j| >=
// |s_ij - cross|. All on the device.
Tensor fp16_prescales(const DistillBackwardInputs& in, const Tensor& rows, const Tensor& cols,
                      const Tensor& scale_f, int64_t T) {
  const int64_t M = rows.size(0), K = cols.size(0);
  const auto f32 = rows.options().dtype(at::kFloat);
  const Tensor one = at::ones({}, f32), zeros_m = at::zeros({M}, f32), zeros_k = at::zeros({K}, f32);
  auto sum_over_teachers = [](const Tensor& g) { return g.defined() ? g.abs().sum(0) : Tensor(); };
  std::vector<Tensor> prescales;
  prescales.push_back(fp16_gradient_prescale(
      one, abs_sum({in.g_row_lse, sum_over_teachers(in.g_row_cross)}, zeros_m),
      abs_sum({in.g_col_lse, sum_over_teachers(in.g_col_cross)}, zeros_k),
      in.g_pos.defined() ? in.g_pos : zeros_m));
  const Tensor width = 2 * scale_f.abs() * rows.to(at::kFloat).norm(2, 1).max() * cols.to(at::kFloat).norm(2, 1).max();
  for (int64_t t = 0; t < T; ++t) {
    auto term = [&](const Tensor& g_lse, const Tensor& g_cross, const Tensor& zeros) {
      Tensor total = g_lse.defined() ? g_lse[t].abs() : zeros.clone();
      if (g_cross.defined()) total.add_(g_cross[t].abs() * width);
      return total;
    };
    prescales.push_back(fp16_gradient_prescale(one, term(in.g_teacher_row_lse, in.g_row_cross, zeros_m),
                                               term(in.g_teacher_col_lse, in.g_col_cross, zeros_k), zeros_m));
  }
  return at::stack(prescales);
}

// d scale = sum_ij dS_ij rows_i . cols_j = sum(rows * (dS @ cols)) from the unscaled fp32 row
// gradient; then the gradients get their logit scale and the features' dtypes.
std::tuple<Tensor, Tensor, Tensor> scaled_gradients(std::pair<Tensor, Tensor> unscaled, const Tensor& rows,
                                                    const Tensor& cols, const Tensor& scale) {
  auto [g_rows, g_cols] = unscaled;
  const Tensor grad_scale = (rows.to(at::kFloat) * g_rows).sum();
  return {(g_rows * scale).to(rows.scalar_type()), (g_cols * scale).to(cols.scalar_type()), grad_scale};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> distill_lse_backward_cuda(
    const std::optional<Tensor>& grad_row_lse, const std::optional<Tensor>& grad_pos_logit,
    const std::optional<Tensor>& grad_teacher_row_lse, const std::optional<Tensor>& grad_row_cross,
    const std::optional<Tensor>& grad_col_lse, const std::optional<Tensor>& grad_teacher_col_lse,
    const std::optional<Tensor>& grad_col_cross, const Tensor& rows, const Tensor& cols, const Tensor& teacher_rows,
    const Tensor& teacher_cols, const Tensor& scale, const Tensor& teacher_scale, int64_t pos_offset,
    const Tensor& row_lse, const Tensor& teacher_row_lse, const Tensor& row_cross, const Tensor& col_lse,
    const Tensor& teacher_col_lse, const Tensor& col_cross, bool teacher_grad, int64_t workspace_bytes) {
  const char* op = "distill_lse_backward";
  check_cuda(op, rows, cols, teacher_rows, teacher_cols, scale, teacher_scale, pos_offset, workspace_bytes);
  c10::cuda::CUDAGuard guard(rows.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const DistillBackwardInputs in = distill_backward_inputs(
      op, grad_row_lse, grad_pos_logit, grad_teacher_row_lse, grad_row_cross, grad_col_lse, grad_teacher_col_lse,
      grad_col_cross, rows, cols, teacher_rows, row_lse, teacher_row_lse, row_cross, col_lse, teacher_col_lse,
      col_cross, teacher_grad, at::kFloat);
  const int64_t M = rows.size(0), K = cols.size(0), T = teacher_rows.size(0);
  const int64_t n_teachers = in.needs_teacher() ? T : 0;  // teachers whose logits the kernel reads
  const bool dt_wanted = teacher_grad && n_teachers > 0;
  const auto f32 = rows.options().dtype(at::kFloat);
  const Tensor scale_f = scale.to(at::kFloat).reshape({}), teacher_scale_f = teacher_scale.to(at::kFloat).contiguous();
  const auto s_dtype = rows.scalar_type(), t_dtype = teacher_rows.scalar_type();
  // Workspace per logit: the fp32 dots and the dlogits of the student and the teachers read.
  const int64_t per_logit = 4 + rows.element_size() + n_teachers * (4 + (dt_wanted ? teacher_rows.element_size() : 0));
  const int64_t kc = chunked::chunk_columns(M, K, per_logit, workspace_bytes);
  const bool fp16 = s_dtype == at::kHalf || (dt_wanted && t_dtype == at::kHalf);
  const Tensor prescale = fp16 ? fp16_prescales(in, rows, cols, scale_f, T) : Tensor();
  // Each prescale serves only a 16-bit fp16 dlogits buffer; others are written unscaled.
  const Tensor unit = at::ones({1 + T, 2}, f32);
  if (prescale.defined()) {
    if (s_dtype != at::kHalf) prescale[0].copy_(unit[0]);
    if (t_dtype != at::kHalf) prescale.narrow(0, 1, T).copy_(unit.narrow(0, 1, T));
  }
  auto unscale = [&](int64_t which) { return prescale.defined() ? prescale[which][1] : Tensor(); };

  const unsigned gy = grid_rows(M, k::kGradRows);
  const Tensor student_dots = at::empty({M * kc}, f32), teacher_dots = at::empty({n_teachers, M * kc}, f32);
  chunked::GradientAccumulator student(rows, cols, kc, s_dtype, unscale(0), at::kFloat);
  std::vector<chunked::GradientAccumulator> teachers;
  for (int64_t t = 0; t < T && dt_wanted; ++t)
    teachers.emplace_back(teacher_rows[t], teacher_cols[t], kc, t_dtype, unscale(1 + t), at::kFloat);
  const Tensor ds_buffer = at::empty({M * kc}, rows.options());
  const Tensor dt_buffer = at::empty({dt_wanted ? T : 0, M * kc}, teacher_rows.options());

  dispatch_features(s_dtype, [&](auto s_tag) {
    dispatch_features(t_dtype, [&](auto t_tag) {
      using TS = decltype(s_tag);
      using TT = decltype(t_tag);
      for (int64_t begin = 0; begin < K; begin += kc) {
        const int64_t width = std::min(kc, K - begin);
        Tensor s = chunked::workspace_view(student_dots, M, width);
        chunked::mm_into(s, rows, cols.narrow(0, begin, width).t());
        for (int64_t t = 0; t < n_teachers; ++t) {
          Tensor d = chunked::workspace_view(teacher_dots[t], M, width);
          chunked::mm_into(d, teacher_rows[t], teacher_cols[t].narrow(0, begin, width).t());
        }
        Tensor ds = chunked::workspace_view(ds_buffer, M, width);
        const k::GradParams<TS, TT> p{
            s.const_data_ptr<float>(), n_teachers ? teacher_dots.const_data_ptr<float>() : nullptr, M, K, width,
            begin, n_teachers, M * kc, scale_f.const_data_ptr<float>(), teacher_scale_f.const_data_ptr<float>(),
            ptr(prescale), pos_offset, ptr(in.g_row_lse), ptr(in.row_lse), ptr(in.g_pos), ptr(in.g_col_lse),
            ptr(in.col_lse), ptr(in.g_teacher_row_lse), ptr(in.g_row_cross), ptr(in.teacher_row_lse),
            ptr(in.row_cross), ptr(in.g_teacher_col_lse), ptr(in.g_col_cross), ptr(in.teacher_col_lse),
            ptr(in.col_cross), ds.mutable_data_ptr<TS>(), dt_wanted ? dt_buffer.mutable_data_ptr<TT>() : nullptr};
        k::distill_grad_kernel<TS, TT><<<dim3(column_splits(width, gy), gy), k::kThreads, 0, stream>>>(p);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        student.add(begin, ds);
        for (int64_t t = 0; t < int64_t(teachers.size()); ++t)
          teachers[t].add(begin, dt_buffer[t].narrow(0, 0, M * width).view({M, width}));
      }
    });
  });
  auto [grad_rows, grad_cols, grad_scale] = scaled_gradients(student.finish(), rows, cols, scale_f);
  grad_scale = grad_scale.to(scale.scalar_type()).reshape(scale.sizes());
  if (!teacher_grad) {
    const Tensor none = at::empty({0}, teacher_rows.options());
    return {grad_rows, grad_cols, none, none.clone(), grad_scale, at::empty({0}, teacher_scale.options())};
  }
  if (!dt_wanted) {  // no teacher term: dT = 0
    return {grad_rows, grad_cols, at::zeros_like(teacher_rows), at::zeros_like(teacher_cols), grad_scale,
            at::zeros_like(teacher_scale)};
  }
  std::vector<Tensor> g_trows, g_tcols, g_tscale;
  for (int64_t t = 0; t < T; ++t) {
    auto [gr, gc, gs] = scaled_gradients(teachers[t].finish(), teacher_rows[t], teacher_cols[t], teacher_scale_f[t]);
    g_trows.push_back(gr);
    g_tcols.push_back(gc);
    g_tscale.push_back(gs);
  }
  return {grad_rows, grad_cols, at::stack(g_trows), at::stack(g_tcols), grad_scale,
          at::stack(g_tscale).to(teacher_scale.scalar_type())};
}

}  // namespace

TORCH_LIBRARY_IMPL(clipshard, CUDA, m) {
  m.impl("distill_lse", &distill_lse_cuda);
  m.impl("distill_lse_backward", &distill_lse_backward_cuda);
}

}  // namespace clipshard
