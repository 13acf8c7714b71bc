#pragma once
// The bit pattern of an fp32 value and back, on the host (memcpy) and the device (intrinsics).
#include <cstdint>
#include <cstring>

#include "clipshard/macros.h"

namespace clipshard {

CLIPSHARD_HOST_DEVICE uint32_t float_to_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return bits;
#endif
}

CLIPSHARD_HOST_DEVICE float bits_to_float(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float x;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
#endif
}

}  // namespace clipshard
