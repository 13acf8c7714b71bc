// Runs the CUDA AdamW kernel and its launcher (csrc/cuda/adamw_kernels.cuh) on the host through
// emulate_cuda.h, on cases written by tests/cuda_emulation/test_adamw_cuda_emulation.py, which compares the
// results bit for bit with the CPU kernel.
// Build: g++ -std=c++20 -O1 -I<repo>/csrc/cuda -I<repo>/csrc/include -I<this folder> emulate_adamw.cpp
// Usage: emulate_adamw DIR. DIR/cases.txt:
//   <cases>, then per case: <shape: 0 the real LaunchShape, 1 SmallShape> <param storage> <state
//   storage> (0 fp32, 1 fp16, 2 bf16) <stochastic> <seed> <offset> <lr> <beta1> <beta2> <eps>
//   <weight_decay> <maximize> <tensors>, then per tensor: <numel> <index_base> <stream> <step> and four
//   misaligns: its param, grad, exp_avg and exp_avg_sq start that many elements after a 64-byte
//   boundary (FSDP2 shards can put each at its own alignment).
// DIR/inputs.bin: per case and tensor its param, grad, exp_avg and exp_avg_sq, raw. Writes the same
// after one step to DIR/outputs.bin, and prints per case its launches and vector accesses.
#include "emulate_cuda.h"
// The kernel, compiled as host code:
#include "adamw_kernels.cuh"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

using namespace clipshard;
namespace k = clipshard::adamw_cuda;

// A table of 3 tensors and 4 blocks of 64 elements: a 300-element tensor is longer than one table.
struct SmallShape {
  static constexpr int kMaxTensors = 3;
  static constexpr int kMaxBlocks = 4;
  static constexpr int kThreads = 4;
  static constexpr int64_t kChunk = 64;
};

// The fields of AdamWArgs (csrc/adamw_args.h) that launch_all reads, without ATen.
struct Args {
  std::vector<void*> params, exp_avgs, exp_avg_sqs;
  std::vector<const void*> grads;
  std::vector<int64_t> numel, index_base;
  std::vector<uint32_t> stream;
  std::vector<float> neg_step_size, bc2_sqrt;
};

struct Buffer {  // `bytes` bytes starting `misalign_bytes` after a 64-byte boundary
  std::vector<unsigned char> storage;
  unsigned char* data;
  size_t bytes;
  Buffer(size_t n, size_t misalign_bytes) : storage(n + 128), bytes(n) {
    const uintptr_t base = (reinterpret_cast<uintptr_t>(storage.data()) + 63) & ~uintptr_t(63);
    data = reinterpret_cast<unsigned char*>(base) + misalign_bytes;
  }
};

template <Storage P, Storage S, class Shape>
int run(const Args& a, const AdamWHyper& hyper, bool stochastic, uint64_t seed, uint64_t offset) {
  int launches = 0;
  k::launch_all<P, Shape>(a, [&](const k::TensorTable<Shape>& table, int blocks) {
    ++launches;
    emulate_launch_sequential(static_cast<unsigned>(blocks), Shape::kThreads,
                              [&] { k::adamw_kernel<P, S, Shape>(table, hyper, stochastic, seed, offset); });
  });
  return launches;
}

template <class Shape>
int dispatch(int p, int s, const Args& a, const AdamWHyper& h, bool stochastic, uint64_t seed, uint64_t offset) {
  using St = Storage;
  const St ps = static_cast<St>(p), ss = static_cast<St>(s);
#define CLIPSHARD_CASE(PV, SV) \
  if (ps == PV && ss == SV) return run<PV, SV, Shape>(a, h, stochastic, seed, offset);
  CLIPSHARD_CASE(St::kFloat, St::kFloat) CLIPSHARD_CASE(St::kFloat, St::kHalf) CLIPSHARD_CASE(St::kFloat, St::kBFloat16)
  CLIPSHARD_CASE(St::kHalf, St::kFloat) CLIPSHARD_CASE(St::kHalf, St::kHalf) CLIPSHARD_CASE(St::kHalf, St::kBFloat16)
  CLIPSHARD_CASE(St::kBFloat16, St::kFloat) CLIPSHARD_CASE(St::kBFloat16, St::kHalf)
  CLIPSHARD_CASE(St::kBFloat16, St::kBFloat16)
#undef CLIPSHARD_CASE
  return -1;
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
    int shape, p, s, stochastic, maximize, n;
    unsigned long long seed, offset;
    double lr, beta1, beta2, eps, wd;
    if (std::fscanf(cases, "%d %d %d %d %llu %llu %lf %lf %lf %lf %lf %d %d", &shape, &p, &s, &stochastic, &seed,
                    &offset, &lr, &beta1, &beta2, &eps, &wd, &maximize, &n) != 13)
      return 2;
    // As make_adamw_args (csrc/adamw_args.cpp) computes them.
    const AdamWHyper hyper = {static_cast<float>(1.0 - lr * wd), static_cast<float>(1.0 - beta1),
                              static_cast<float>(beta2), static_cast<float>(1.0 - beta2), static_cast<float>(eps),
                              maximize != 0};
    const size_t pb = k::storage_bytes(static_cast<Storage>(p)), sb = k::storage_bytes(static_cast<Storage>(s));
    Args a;
    std::vector<Buffer> buffers;
    buffers.reserve(4 * n);
    for (int t = 0; t < n; ++t) {
      long long numel, base, step;
      unsigned stream;
      int misalign[4];
      if (std::fscanf(cases, "%lld %lld %u %lld %d %d %d %d", &numel, &base, &stream, &step, &misalign[0],
                      &misalign[1], &misalign[2], &misalign[3]) != 8)
        return 2;
      const size_t element_bytes[4] = {pb, pb, sb, sb};
      for (int role = 0; role < 4; ++role) {
        const size_t bytes = element_bytes[role];
        buffers.emplace_back(numel * bytes, misalign[role] * bytes);
        if (std::fread(buffers.back().data, 1, numel * bytes, in) != numel * bytes) return 2;
      }
      a.params.push_back(buffers[4 * t].data);
      a.grads.push_back(buffers[4 * t + 1].data);
      a.exp_avgs.push_back(buffers[4 * t + 2].data);
      a.exp_avg_sqs.push_back(buffers[4 * t + 3].data);
      a.numel.push_back(numel);
      a.index_base.push_back(base);
      a.stream.push_back(stream);
      const double st = static_cast<double>(step);
      a.neg_step_size.push_back(static_cast<float>(-(lr / (1.0 - std::pow(beta1, st)))));
      a.bc2_sqrt.push_back(static_cast<float>(std::sqrt(1.0 - std::pow(beta2, st))));
    }
    g_vector_accesses = 0;
    const int launches = shape == 0 ? dispatch<k::LaunchShape>(p, s, a, hyper, stochastic, seed, offset)
                                    : dispatch<SmallShape>(p, s, a, hyper, stochastic, seed, offset);
    if (launches < 0) return 2;
    for (const Buffer& b : buffers) std::fwrite(b.data, 1, b.bytes, out);
    std::printf("case %d launches %d vector_accesses %lld\n", c, launches, g_vector_accesses);
  }
  std::fclose(out);
  std::printf("ALL DONE\n");
  return 0;
}
