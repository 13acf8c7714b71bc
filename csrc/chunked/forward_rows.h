// The variant of the chunked contrastive forward kernel a call runs (rows per CTA), read by the CUDA
// launcher (csrc/cuda/contrastive_lse_chunked.cu) and by the first-use check's query op
// (csrc/launch_variants.cpp) alike.
#pragma once

#include <cstdint>

#include "../env_vars.h"
#include "clipshard/launch_rules.h"

namespace clipshard::chunked {

// The rows per CTA asked for: CLIPSHARD_CHUNKED_FORWARD_ROWS ("16" or "32"; a benchmark knob, read
// at every call so that one process can time both variants), else the default.
inline int requested_forward_rows() {
  const auto choice = env::choice("CLIPSHARD_CHUNKED_FORWARD_ROWS", {"16", "32"});
  if (!choice) return launch_rules::kChunkedForwardRowsDefault;
  return *choice == 0 ? launch_rules::kChunkedForwardRowsNarrow : launch_rules::kChunkedForwardRowsWide;
}

// Rows per CTA of the forward kernel for M rows (launch_rules.h's rule for the requested variant).
inline int forward_rows_per_cta(int64_t M) {
  return launch_rules::chunked_forward_rows(M, requested_forward_rows(), launch_rules::kChunkedForwardRowsWide);
}

}  // namespace clipshard::chunked
