#pragma once
// The host-side rules that pick the CUDA kernels' grids and variants: plain functions of sizes and
// the device's SM count, torch-free and CUDA-free, so that the launchers in csrc/cuda/*.cu, the host
// emulation of the kernels (tests/cuda_emulation) and the first-use check (whose query ops in
// csrc/launch_variants.cpp key its verdicts by the variant a call runs) all call the same code.
#include <algorithm>
#include <cstdint>

namespace clipshard {
namespace launch_rules {

// A grid's y (and z) dimension is at most 65535.
constexpr int64_t kMaxGridY = 65535;

// The compiled variants the rules pick from; the kernel headers take their constants from these.
// chunk_forward_kernel<kRows>: 32 row states per thread (one CTA per SM) or 16 (two CTAs per SM).
constexpr int kChunkedForwardRowsWide = 32;
constexpr int kChunkedForwardRowsNarrow = 16;
constexpr int kChunkedForwardRowsDefault = kChunkedForwardRowsWide;
// siglip_ids_chunk_kernel: at most this many rows per CTA (row states in registers).
constexpr int kSiglipMaxIdRows = 8;
// distill_forward_kernel<kTeachers>: at most this many teachers folded by one launch.
constexpr int kDistillMaxLaunchTeachers = 2;

constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// contrastive_lse's pos_offset as its kernels take it: pos_offset itself, or K for -1 (no
// positives: no column j < K is then pos_offset + i, and every kernel's "positive" test is false;
// the column pass of the fused kernels gets its negation, -K, for which no row is one either).
constexpr int64_t contrastive_kernel_pos_offset(int64_t pos_offset, int64_t K) {
  return pos_offset == -1 ? K : pos_offset;
}

// Column splits of the chunked kernels (contrastive, distillation): enough CTAs for about three per
// SM, each with as many column steps of `threads` columns as possible (every CTA ends with a
// reduction of its row states, worth amortising); at least 1, at most one per column step.
inline unsigned chunk_column_splits(int64_t width, int64_t n_row_blocks, int64_t sms, int threads) {
  const int64_t steps = ceil_div(width, threads);
  const int64_t wanted = ceil_div(3 * sms, std::max<int64_t>(n_row_blocks, 1));
  return static_cast<unsigned>(std::clamp<int64_t>(wanted, 1, std::max<int64_t>(steps, 1)));
}

// The grid's y dimension for blocks of rows_per_cta rows when the kernel loops over row blocks (a
// CTA takes blocks blockIdx.y, blockIdx.y + gridDim.y, ...): one CTA row per block up to the cap.
// The cap is kMaxGridY on a GPU; the emulation lowers it to run the loop on small sizes.
inline unsigned looping_grid_rows(int64_t M, int rows_per_cta, int64_t max_grid_rows = kMaxGridY) {
  return static_cast<unsigned>(std::min(ceil_div(M, rows_per_cta), max_grid_rows));
}

// Rows per CTA of the chunked contrastive forward: the requested variant (16 or 32 rows), unless
// its grid (one CTA row per row block, no loop) would exceed kMaxGridY: then the wide one, so that
// the forward takes every M the backward takes.
constexpr int chunked_forward_rows(int64_t M, int requested_rows, int wide_rows) {
  return M > kMaxGridY * requested_rows ? wide_rows : requested_rows;
}

// Rows per CTA of siglip_ids_chunk_kernel: the most (up to max_rows, fewer id loads) that still
// leave four CTAs per SM, so that small batches keep the whole GPU streaming. A power of two.
inline int siglip_ids_rows_per_cta(int64_t M, int64_t sms, int max_rows) {
  const int64_t ctas_wanted = 4 * sms;
  int rows = max_rows;
  while (rows > 1 && ceil_div(M, rows) < ctas_wanted) rows /= 2;
  return rows;
}

// Teachers folded by the distillation forward launch that starts at teacher `first` of T:
// kDistillMaxLaunchTeachers per launch, the last launch of an odd T one.
constexpr int distill_launch_teachers(int64_t T, int64_t first) {
  return static_cast<int>(std::min<int64_t>(T - first, kDistillMaxLaunchTeachers));
}

}  // namespace launch_rules
}  // namespace clipshard
