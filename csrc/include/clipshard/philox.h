#pragma once
// The random words behind stochastic rounding. Element i of a tensor (its row-major index) uses
// 32-bit word (i mod 4) of Philox4x32-10 with key = seed and a 128-bit counter whose low 64 bits
// are i / 4 and whose high 64 bits are `offset`. That is the stream of ATen's at::Philox4_32
// constructed with (seed, subsequence = offset, offset = i / 4), and of curand's Philox4_32_10
// likewise (the tests check this against ATen and Random123's published answers). Written here as
// a stateless function, torch-free, so that a loop over blocks vectorises on the CPU.
#include <cstdint>

#include "clipshard/macros.h"

namespace clipshard {

struct PhiloxWords {
  uint32_t w[4];
};

constexpr uint32_t kPhiloxM0 = 0xD2511F53u, kPhiloxM1 = 0xCD9E8D57u;  // round multipliers
constexpr uint32_t kPhiloxW0 = 0x9E3779B9u, kPhiloxW1 = 0xBB67AE85u;  // key schedule increments

CLIPSHARD_HOST_DEVICE uint32_t philox_mulhi(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __umulhi(a, b);
#else
  return static_cast<uint32_t>((static_cast<uint64_t>(a) * b) >> 32);
#endif
}

// The four words shared by elements 4*block .. 4*block + 3.
CLIPSHARD_HOST_DEVICE PhiloxWords philox_block(uint64_t seed, uint64_t offset, uint64_t block) {
  uint32_t c0 = static_cast<uint32_t>(block), c1 = static_cast<uint32_t>(block >> 32);
  uint32_t c2 = static_cast<uint32_t>(offset), c3 = static_cast<uint32_t>(offset >> 32);
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int round = 0; round < 10; ++round) {  // the key is bumped between rounds
    const uint32_t hi0 = philox_mulhi(kPhiloxM0, c0), lo0 = kPhiloxM0 * c0;
    const uint32_t hi1 = philox_mulhi(kPhiloxM1, c2), lo1 = kPhiloxM1 * c2;
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
    k0 += kPhiloxW0;
    k1 += kPhiloxW1;
  }
  return PhiloxWords{{c0, c1, c2, c3}};
}

}  // namespace clipshard
