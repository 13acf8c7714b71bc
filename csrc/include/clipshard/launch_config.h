#pragma once
// The host-side choices of which compiled CUDA kernel variant a launch runs, as plain functions of
// the problem's sizes and the GPU (no torch, no CUDA): the CUDA launchers in csrc/cuda call them to
// pick the variant, and csrc/launch_variants.cpp exposes the same functions as ops, so that the
// first-use check (clipshard/ops/first_use.py) keys its verdicts by the variant a call will run
// and probes that variant. One rule, two callers: it cannot drift.
#include <cstdint>

namespace clipshard::launch {

// --- contrastive_lse, algorithm "chunked": rows per CTA of chunk_forward_kernel<kRows, ...>
constexpr int kChunkedForwardRowsWide = 32;    // 32 row states per thread (one CTA per SM)
constexpr int kChunkedForwardRowsNarrow = 16;  // 16 (two CTAs per SM)
constexpr int kChunkedForwardRowsDefault = kChunkedForwardRowsWide;
// The grid's y dimension (row blocks) is at most this.
constexpr int64_t kChunkedMaxRowBlocks = 65535;

// The forward variant for M rows when `requested` (16 or 32) rows per CTA are asked for: past the
// narrow variant's 65535 x 16 rows the wide one runs, so that the forward takes every M the
// backward takes.
inline int chunked_forward_rows_per_cta(int64_t M, int requested) {
  return M > kChunkedMaxRowBlocks * requested ? kChunkedForwardRowsWide : requested;
}

// --- siglip_forward with sample ids: rows per CTA of siglip_ids_chunk_kernel
constexpr int kSiglipMaxIdRows = 8;

// The most rows per CTA (up to kSiglipMaxIdRows: fewer id loads) that still leave four CTAs per SM,
// so that small batches keep the whole GPU streaming. A power of two from 1 to 8.
inline int siglip_ids_rows_per_cta(int64_t M, int64_t multiprocessors) {
  const int64_t ctas_wanted = 4 * multiprocessors;
  int rows = kSiglipMaxIdRows;
  while (rows > 1 && (M + rows - 1) / rows < ctas_wanted) rows /= 2;
  return rows;
}

// --- distill_lse forward: teachers per launch of distill_forward_kernel<kTeachers>
constexpr int kDistillMaxLaunchTeachers = 2;

// The teachers folded by the launch that starts at teacher `first` of T: two per launch, the last
// launch of an odd T one.
inline int distill_launch_teachers(int64_t T, int64_t first) {
  return static_cast<int>(T - first < kDistillMaxLaunchTeachers ? T - first : kDistillMaxLaunchTeachers);
}

}  // namespace clipshard::launch
