// A test op that runs the chunk driver's gradient pass (chunked_gradients, GradientAccumulator) on
// logit gradients the test gives, so that the CPU tests reach the paths only CUDA's 16-bit and fp16
// pre-scaled calls take: the fp32 buffer of the columns' gradient, filled column_buffer_rows
// columns at a time, with an unscale factor or a 16-bit output.
#include <torch/library.h>

#include "chunk_driver.h"

namespace {

using namespace clipshard;

// grad_rows = unscale * dlogits @ cols and grad_cols = unscale * dlogits^T @ rows, in out_dtype
// (default: rows' dtype), computed chunk by chunk with chunks of `chunk_columns` columns.
std::tuple<at::Tensor, at::Tensor> chunked_gradients_op(const at::Tensor& rows, const at::Tensor& cols,
                                                        const at::Tensor& dlogits,
                                                        const std::optional<at::Tensor>& unscale,
                                                        std::optional<at::ScalarType> out_dtype,
                                                        int64_t chunk_columns) {
  TORCH_CHECK(rows.dim() == 2 && cols.dim() == 2 && rows.size(1) == cols.size(1),
              "chunked_gradients: rows (M x D) and cols (K x D) must share D");
  TORCH_CHECK(rows.scalar_type() == cols.scalar_type() &&
                  chunked::accumulate_type(rows.scalar_type()) == rows.scalar_type(),
              "chunked_gradients: rows and cols must both be fp32 or both fp64");
  TORCH_CHECK(dlogits.sizes() == at::IntArrayRef({rows.size(0), cols.size(0)}) &&
                  dlogits.scalar_type() == rows.scalar_type(),
              "chunked_gradients: dlogits must be M x K in the features' dtype");
  TORCH_CHECK(chunk_columns > 0, "chunked_gradients: chunk_columns must be positive, got ", chunk_columns);
  const at::Tensor r = rows.contiguous(), c = cols.contiguous();
  const at::Tensor factor = unscale.has_value() ? unscale->to(at::kFloat) : at::Tensor();
  auto [grad_rows, grad_cols] = chunked::chunked_gradients(
      r, c, chunk_columns, r.scalar_type(), factor,
      [&](const chunked::Chunk& chunk, at::Tensor& out) { out.copy_(dlogits.narrow(1, chunk.begin, chunk.width)); },
      out_dtype);
  return {grad_rows, grad_cols};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(clipshard_testing, m) {
  // The chunk driver's gradient pass on given logit gradients (see above); rows and cols fp32 or fp64,
  // unscale a 0-dim tensor.
  m.def("chunked_gradients(Tensor rows, Tensor cols, Tensor dlogits, Tensor? unscale, ScalarType? out_dtype, "
        "int chunk_columns) -> (Tensor grad_rows, Tensor grad_cols)");
}

TORCH_LIBRARY_IMPL(clipshard_testing, CPU, m) { m.impl("chunked_gradients", &chunked_gradients_op); }
