#pragma once
// The random words behind stochastic rounding. Element i of a tensor (its row-major index) uses
// 32-bit word (i mod 4) of Philox4x32-10 with key = seed and a 128-bit counter whose low 64 bits
// are i / 4 and whose high 64 bits are `offset`. That is ATen's at::Philox4_32 constructed with
// (seed, subsequence = offset, offset = i / 4), and curand's Philox4_32_10 likewise, so we reuse
// ATen's host/device engine rather than writing another.
#include <ATen/core/PhiloxRNGEngine.h>
#include <cstdint>

#include "clipshard/macros.h"

namespace clipshard {

struct PhiloxWords {
  uint32_t w[4];
};

// The four words shared by elements 4*block .. 4*block + 3.
CLIPSHARD_HOST_DEVICE PhiloxWords philox_block(uint64_t seed, uint64_t offset, uint64_t block) {
  at::Philox4_32 engine(seed, /*subsequence=*/offset, /*offset=*/block);
  PhiloxWords out;
  out.w[0] = engine();
  out.w[1] = engine();
  out.w[2] = engine();
  out.w[3] = engine();
  return out;
}

}  // namespace clipshard
