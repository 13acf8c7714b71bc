// Runs the CUDA stochastic-rounding kernels (csrc/cuda/stochastic_round_kernels.cuh) on the host
// through emulate_cuda.h, on cases written by tests/cuda_emulation/test_stochastic_round_cuda_emulation.py, which
// compares the results bit for bit with the CPU kernel.
// Build: g++ -std=c++20 -O1 -I<repo>/csrc/cuda -I<repo>/csrc/include -I<this folder> emulate_stochastic_round.cpp
// Usage: emulate_stochastic_round DIR. DIR/cases.txt: <cases>, then per case: <n> <bf16> <saturate>
// <seed> <offset> <vectorized> <grid> <misalign> (misalign: source and destination start that many
// elements after a 64-byte boundary; the vectorized kernel needs 0). DIR/inputs.bin: per case n
// fp32 values. Writes per case n 16-bit results to DIR/outputs.bin (0xDEAD where nothing was written).
#include "emulate_cuda.h"
// The kernels, compiled as host code:
#include "stochastic_round_kernels.cuh"

#include <cstdio>
#include <string>
#include <vector>

namespace k = clipshard::stochastic_round_kernels;

template <bool kBf16, bool kSaturate>
void run(const uint32_t* src, uint16_t* dst, int64_t n, uint64_t seed, uint64_t offset, bool vectorized,
         unsigned grid) {
  emulate_launch_sequential(grid, k::kThreads, [&] {
    if (vectorized) {
      k::round_vectorized_kernel<kBf16, kSaturate>(src, dst, n, seed, offset);
    } else {
      k::round_scalar_kernel<kBf16, kSaturate>(src, dst, n, seed, offset);
    }
  });
}

template <typename T>
T* aligned_at(std::vector<unsigned char>& storage, int misalign) {
  const uintptr_t base = (reinterpret_cast<uintptr_t>(storage.data()) + 63) & ~uintptr_t(63);
  return reinterpret_cast<T*>(base) + misalign;
}

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  const std::string dir = argv[1];
  FILE* cases = std::fopen((dir + "/cases.txt").c_str(), "r");
  FILE* in = std::fopen((dir + "/inputs.bin").c_str(), "rb");
  FILE* out = std::fopen((dir + "/outputs.bin").c_str(), "wb");
  if (!cases || !in || !out) return 2;
  int n_cases = 0;
  if (std::fscanf(cases, "%d", &n_cases) != 1) return 2;
  for (int c = 0; c < n_cases; ++c) {
    long long n;
    int bf16, saturate, vectorized, misalign;
    unsigned grid;
    unsigned long long seed, offset;
    if (std::fscanf(cases, "%lld %d %d %llu %llu %d %u %d", &n, &bf16, &saturate, &seed, &offset, &vectorized, &grid,
                    &misalign) != 8)
      return 2;
    std::vector<unsigned char> src_storage(4 * n + 128), dst_storage(2 * n + 128);
    uint32_t* src = aligned_at<uint32_t>(src_storage, misalign);
    uint16_t* dst = aligned_at<uint16_t>(dst_storage, misalign);
    if (std::fread(src, 4, n, in) != static_cast<size_t>(n)) return 2;
    for (long long i = 0; i < n; ++i) dst[i] = 0xDEAD;
    if (bf16) {
      saturate ? run<true, true>(src, dst, n, seed, offset, vectorized, grid)
               : run<true, false>(src, dst, n, seed, offset, vectorized, grid);
    } else {
      saturate ? run<false, true>(src, dst, n, seed, offset, vectorized, grid)
               : run<false, false>(src, dst, n, seed, offset, vectorized, grid);
    }
    std::fwrite(dst, 2, n, out);
  }
  std::fclose(out);
  std::printf("ALL DONE\n");
  return 0;
}
