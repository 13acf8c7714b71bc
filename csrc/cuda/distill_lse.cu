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
#include "dispatch_features.h"
#include "distill_launch.h"
#include "fp16_prescale.h"

namespace clipshard {
namespace {

using at::Tensor;
namespace k = distill_cuda;

// Runs kernel<<<grid, kThreads>>>(args...) on the stream: the launcher of distill_launch.h.
auto launcher(cudaStream_t stream) {
  return [stream](auto kernel, dim3 grid, auto... args) {
    kernel<<<grid, k::kThreads, 0, stream>>>(args...);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
}

k::LaunchShape launch_shape(int64_t M, int64_t K, int64_t T, int64_t pos_offset, bool want_columns) {
  return {M, K, T, pos_offset, want_columns, at::cuda::getCurrentDeviceProperties()->multiProcessorCount,
          launch_rules::kMaxGridY};
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
  const k::LaunchShape shape = launch_shape(M, K, T, pos_offset, want_columns);
  const int64_t n_blocks = k::row_blocks_of(M, k::kForwardRows);
  const int64_t gx_max = k::forward_column_splits(shape, kc), pair = k::forward_launch_teachers(shape);
  const Tensor student_dots = at::empty({M * kc}, f32), teacher_dots = at::empty({T, M * kc}, f32);
  Tensor running = empty_states(M, 2, f32), teacher_running = empty_states(T * M, 3, f32);
  const Tensor row_partial = at::empty({gx_max * M * 2}, f32);
  const Tensor teacher_row_partial = at::empty({pair * gx_max * M * 3}, f32);
  const Tensor col_partial = want_columns ? at::empty({n_blocks * kc * 2}, f32) : Tensor();
  const Tensor teacher_col_partial = want_columns ? at::empty({pair * n_blocks * kc * 3}, f32) : Tensor();
  const int64_t Kc = want_columns ? K : 0;
  Tensor row_lse = at::empty({M}, f32), pos_logit = at::empty({M}, f32);
  Tensor teacher_row_lse = at::empty({T, M}, f32), row_cross = at::empty({T, M}, f32);
  Tensor col_lse = at::empty({Kc}, f32), teacher_col_lse = at::empty({T, Kc}, f32), col_cross = at::empty({T, Kc}, f32);
  auto columns_out = [&](Tensor& t) { return want_columns ? t.mutable_data_ptr<float>() : nullptr; };
  const k::ForwardBuffers buffers{
      student_dots.const_data_ptr<float>(), teacher_dots.const_data_ptr<float>(), M * kc,
      scale_f.const_data_ptr<float>(), teacher_scale_f.const_data_ptr<float>(), as_states<k::Lse>(running),
      as_states<k::Stat>(teacher_running), as_states<k::Lse>(row_partial), as_states<k::Stat>(teacher_row_partial),
      want_columns ? as_states<k::Lse>(col_partial) : nullptr,
      want_columns ? as_states<k::Stat>(teacher_col_partial) : nullptr, row_lse.mutable_data_ptr<float>(),
      pos_logit.mutable_data_ptr<float>(), teacher_row_lse.mutable_data_ptr<float>(),
      row_cross.mutable_data_ptr<float>(), columns_out(col_lse), columns_out(teacher_col_lse),
      columns_out(col_cross)};

  for (int64_t begin = 0; begin < K; begin += kc) {
    const int64_t width = std::min(kc, K - begin);
    Tensor s = chunked::workspace_view(student_dots, M, width);
    chunked::mm_into(s, rows, cols.narrow(0, begin, width).t());
    k::forward_chunk(shape, buffers, begin, width, [&](int64_t t) {
      Tensor d = chunked::workspace_view(teacher_dots[t], M, width);
      chunked::mm_into(d, teacher_rows[t], teacher_cols[t].narrow(0, begin, width).t());
    }, launcher(stream));
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

  const k::LaunchShape shape = launch_shape(M, K, T, pos_offset, /*want_columns=*/true);
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
        k::grad_chunk(shape, p, launcher(stream));
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
