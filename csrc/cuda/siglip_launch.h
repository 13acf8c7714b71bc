// The host launch of the SigLIP chunk kernels (docs/siglip.md), torch-free: which kernel, its grid
// and, with sample ids, its rows per CTA. csrc/cuda/siglip.cu calls it with a launcher that runs
// kernel<<<...>>> on the current stream; tests/cuda_emulation/emulate_siglip.cpp with one that runs
// the kernel on the host. A launcher is called as launch(kernel, dim3 grid, params), kThreads
// threads per CTA.
#pragma once

#include <cstdint>

#include "clipshard/launch_rules.h"
#include "siglip_kernels.cuh"

namespace clipshard {
namespace siglip_cuda {

// Sample ids of the chunk's rows and of all columns, or nullptr for none.
struct ChunkIds {
  const int64_t* rows;
  const int64_t* cols;
  bool mask_same_ids;
  int rows_per_cta;  // launch_rules::siglip_ids_rows_per_cta(M, SMs, kIdRows)
};

// One CTA per row without ids; with them ceil(M / rows_per_cta) CTAs of siglip_ids_chunk_kernel.
template <typename DL, bool kGrad, typename Launch>
void launch_chunk(const ChunkParams<DL>& p, const ChunkIds& ids, Launch&& launch) {
  if (ids.rows == nullptr) {
    launch(siglip_chunk_kernel<DL, kGrad>, dim3{static_cast<unsigned>(p.rows), 1, 1}, p);
    return;
  }
  const IdChunkParams<DL> q{p, ids.rows, ids.cols, ids.mask_same_ids, ids.rows_per_cta};
  const auto ctas = static_cast<unsigned>(launch_rules::ceil_div(p.rows, ids.rows_per_cta));
  launch(siglip_ids_chunk_kernel<DL, kGrad>, dim3{ctas, 1, 1}, q);
}

}  // namespace siglip_cuda
}  // namespace clipshard
