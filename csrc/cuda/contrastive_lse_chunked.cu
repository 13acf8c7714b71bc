// Launches of the chunked contrastive_lse on CUDA (see contrastive_lse_chunked.h): the chunk
// driver of csrc/chunked runs the GEMMs, the kernels of contrastive_lse_chunked_kernels.cuh the
// rest. Everything is on the current stream; nothing waits for the device.
#include "contrastive_lse_chunked.h"

#include <ATen/cuda/CUDAContext.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "../chunked/chunk_driver.h"
#include "../chunked/forward_rows.h"
#include "clipshard/launch_rules.h"
#include "contrastive_lse_chunked_kernels.cuh"
#include "dispatch_features.h"
#include "fp16_prescale.h"

namespace clipshard {
namespace {

using at::Tensor;
namespace k = chunked_cuda;

// Workspace bytes per logit: the fp32 chunk plus the column partials (8 bytes per block of 16 or
// 32 rows), rounded up; the gradient pass adds the dlogits chunk.
constexpr int64_t kForwardBytesPerLogit = 5;

using launch_rules::ceil_div;

// The grid's y dimension (row blocks) is at most 65535.
constexpr int64_t kMaxRowBlocks = launch_rules::kMaxGridY;

// The forward kernel variant (docs/fused_loss_cuda.md, "Resources per kernel"): rows per CTA, from
// chunked::forward_rows_per_cta (csrc/chunked/forward_rows.h: CLIPSHARD_CHUNKED_FORWARD_ROWS, else
// launch_rules.h's default; the wide variant past the narrow one's 65535 * 16 rows, so that the
// forward takes every M the backward takes), which the first-use check queries too. The GPU check
// benchmarks both variants.
static_assert(k::kForwardRowsWide == k::kRowsPerCta, "forward and backward row limits agree");

// Row blocks of rows_per_cta rows: the grid's y dimension.
unsigned row_blocks(const char* fn, int64_t M, int rows_per_cta) {
  const int64_t n = ceil_div(M, rows_per_cta);
  TORCH_CHECK(n <= kMaxRowBlocks, fn, ": too many rows (", M, ") for the chunked kernels' grid (at most ",
              kMaxRowBlocks * rows_per_cta, ")");
  return static_cast<unsigned>(n);
}

// Column splits (launch_rules.h): about three CTAs per SM.
unsigned column_splits(int64_t width, unsigned n_row_blocks) {
  return launch_rules::chunk_column_splits(width, n_row_blocks,
                                           at::cuda::getCurrentDeviceProperties()->multiProcessorCount, k::kThreads);
}

k::Lse* as_states(const Tensor& t) { return reinterpret_cast<k::Lse*>(t.data_ptr<float>()); }

const int64_t* ids_ptr(const Tensor& ids) { return ids.defined() ? ids.const_data_ptr<int64_t>() : nullptr; }

template <int kRows>
std::tuple<Tensor, Tensor, Tensor> forward_chunked(const Tensor& rows, const Tensor& cols, const Tensor& scale,
                                                   int64_t pos_offset, const Tensor& row_ids, const Tensor& col_ids,
                                                   bool want_col_lse, int64_t workspace_bytes) {
  const int64_t M = rows.size(0), K = cols.size(0);
  const int64_t kc = chunked::chunk_columns(M, K, kForwardBytesPerLogit, workspace_bytes);
  const unsigned gy = row_blocks("contrastive_lse_forward", M, kRows);
  const auto f32 = rows.options().dtype(at::kFloat);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();

  // Running (max, sum) of every row across chunks: starts empty.
  Tensor running = at::empty({M, 2}, f32);
  running.select(1, 0).fill_(-std::numeric_limits<float>::infinity());
  running.select(1, 1).zero_();
  const Tensor row_partial = at::empty({int64_t(column_splits(kc, gy)) * M * 2}, f32);
  const Tensor col_partial = want_col_lse ? at::empty({int64_t(gy) * kc * 2}, f32) : Tensor();
  Tensor row_lse = at::empty({M}, f32), pos_logit = at::empty({M}, f32);
  Tensor col_lse = at::empty({want_col_lse ? K : 0}, f32);

  chunked::for_each_chunk(rows, cols, kc, [&](const chunked::Chunk& chunk) {
    const unsigned gx = column_splits(chunk.width, gy);
    const k::ForwardChunkParams p{chunk.dots.const_data_ptr<float>(), M, chunk.width, chunk.begin,
                                  scale.const_data_ptr<float>(), pos_offset, as_states(row_partial),
                                  want_col_lse ? as_states(col_partial) : nullptr,
                                  pos_logit.mutable_data_ptr<float>(), ids_ptr(row_ids), ids_ptr(col_ids)};
    if (p.row_ids != nullptr)
      k::chunk_forward_kernel<kRows, true><<<dim3(gx, gy), k::kThreads, 0, stream>>>(p);
    else
      k::chunk_forward_kernel<kRows><<<dim3(gx, gy), k::kThreads, 0, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    const bool last = chunk.begin + chunk.width == K;
    k::merge_row_partials_kernel<<<ceil_div(M, k::kThreads), k::kThreads, 0, stream>>>(
        as_states(running), as_states(row_partial), M, static_cast<int>(gx),
        last ? row_lse.mutable_data_ptr<float>() : nullptr);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    if (want_col_lse) {
      k::merge_col_partials_kernel<<<ceil_div(chunk.width, k::kThreads), k::kThreads, 0, stream>>>(
          as_states(col_partial), chunk.width, static_cast<int>(gy), chunk.begin, col_lse.mutable_data_ptr<float>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  });
  return {row_lse, pos_logit, col_lse};
}

}  // namespace

std::tuple<Tensor, Tensor, Tensor> contrastive_lse_forward_chunked_cuda(
    const Tensor& rows, const Tensor& cols, const Tensor& scale, int64_t pos_offset, const Tensor& row_ids,
    const Tensor& col_ids, bool want_col_lse, int64_t workspace_bytes) {
  if (chunked::forward_rows_per_cta(rows.size(0)) == k::kForwardRowsNarrow)
    return forward_chunked<k::kForwardRowsNarrow>(rows, cols, scale, pos_offset, row_ids, col_ids, want_col_lse,
                                                  workspace_bytes);
  return forward_chunked<k::kForwardRowsWide>(rows, cols, scale, pos_offset, row_ids, col_ids, want_col_lse,
                                              workspace_bytes);
}

std::tuple<Tensor, Tensor, Tensor, Tensor> contrastive_lse_backward_chunked_cuda(
    const Tensor& g_row, const Tensor& g_pos, const Tensor& g_col, const Tensor& rows, const Tensor& cols,
    const Tensor& scale, int64_t pos_offset, const Tensor& row_ids, const Tensor& col_ids, const Tensor& row_lse,
    const Tensor& col_lse, int64_t workspace_bytes) {
  const int64_t M = rows.size(0), K = cols.size(0);
  const int64_t kc = chunked::chunk_columns(M, K, 4 + int64_t(rows.element_size()), workspace_bytes);
  const unsigned gy = row_blocks("contrastive_lse_backward", M, k::kRowsPerCta);
  const auto f32 = rows.options().dtype(at::kFloat);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const bool fp16 = rows.scalar_type() == at::kHalf;
  const Tensor prescale = fp16 ? fp16_gradient_prescale(scale, g_row, g_col, g_pos) : Tensor();
  const Tensor unscale = fp16 ? prescale[1] : Tensor();

  // Per-CTA sums of a group of up to kChunkGroup chunks (zero where a chunk used fewer CTAs), folded
  // into fp64 totals after each group in a fixed order: O(kChunkGroup x slots) floats whatever K (a
  // buffer for every chunk was 512 MiB at M = K = 524288). With at most kChunkGroup chunks, the
  // totals are the one fp64 sum of all partial sums, as before the grouping.
  constexpr int64_t kChunkGroup = 64;
  const int64_t slots = int64_t(gy) * column_splits(kc, gy);
  const int64_t group = std::min(ceil_div(K, kc), kChunkGroup);
  Tensor partial_scale = at::zeros({group, slots}, f32), partial_bias = at::zeros({group, slots}, f32);
  Tensor total_scale = at::zeros({}, f32.dtype(at::kDouble)), total_bias = at::zeros({}, f32.dtype(at::kDouble));
  const auto fold_group = [&](int64_t chunks) {
    total_scale += partial_scale.narrow(0, 0, chunks).sum(at::kDouble);
    total_bias += partial_bias.narrow(0, 0, chunks).sum(at::kDouble);
    partial_scale.zero_();
    partial_bias.zero_();
  };
  int64_t chunk_index = 0;
  Tensor grad_rows, grad_cols;
  dispatch_features(rows.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    std::tie(grad_rows, grad_cols) = chunked::chunked_gradients(
        rows, cols, kc, rows.scalar_type(), unscale, [&](const chunked::Chunk& chunk, Tensor& dlogits) {
          const unsigned gx = column_splits(chunk.width, gy);
          const k::GradChunkParams<T> p{
              chunk.dots.const_data_ptr<float>(), M, chunk.width, chunk.begin, scale.const_data_ptr<float>(),
              fp16 ? prescale.const_data_ptr<float>() : nullptr, row_lse.const_data_ptr<float>(),
              g_row.const_data_ptr<float>(), g_pos.const_data_ptr<float>(),
              g_col.defined() ? col_lse.const_data_ptr<float>() : nullptr,
              g_col.defined() ? g_col.const_data_ptr<float>() : nullptr, pos_offset, dlogits.mutable_data_ptr<T>(),
              partial_scale[chunk_index % group].mutable_data_ptr<float>(),
              partial_bias[chunk_index % group].mutable_data_ptr<float>(),
              ids_ptr(row_ids), ids_ptr(col_ids)};
          if (p.row_ids != nullptr)
            k::chunk_grad_kernel<T, true><<<dim3(gx, gy), k::kThreads, 0, stream>>>(p);
          else
            k::chunk_grad_kernel<T><<<dim3(gx, gy), k::kThreads, 0, stream>>>(p);
          C10_CUDA_KERNEL_LAUNCH_CHECK();
          if (++chunk_index % group == 0) fold_group(group);
        });
  });
  if (chunk_index % group != 0) fold_group(chunk_index % group);
  return {grad_rows, grad_cols, total_scale.to(at::kFloat), total_bias.to(at::kFloat)};
}

}  // namespace clipshard
