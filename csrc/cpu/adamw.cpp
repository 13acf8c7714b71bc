// CPU kernel of clipshard::adamw_step_: one parallel pass over all elements of all tensors.
// Elements are processed in blocks of kBlock: load and widen to fp32, update (a straight-line loop
// the compiler vectorises), then narrow and store, drawing Philox words for the 16-bit outputs.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "clipshard/adamw.h"
#include "clipshard/philox.h"
#include "../adamw_args.h"

namespace clipshard {
namespace {

constexpr int64_t kBlock = 256;           // elements per inner block (a multiple of 4)
constexpr int64_t kChunk = 64 * kBlock;   // elements per parallel work item

template <Storage S>
void load(const void* base, int64_t begin, int64_t n, float* out) {
  if constexpr (S == Storage::kFloat) {
    const float* src = static_cast<const float*>(base) + begin;
    for (int64_t j = 0; j < n; ++j) out[j] = src[j];
  } else {
    const uint16_t* src = static_cast<const uint16_t*>(base) + begin;
    for (int64_t j = 0; j < n; ++j) out[j] = storage_to_float<S>(src[j]);
  }
}

// Stores n values of `in` to elements begin .. begin + n of the tensor (begin a multiple of 4).
template <Storage S>
void store(void* base, int64_t begin, int64_t n, const float* in, bool stochastic, uint64_t seed,
           uint64_t offset, uint64_t stream) {
  if constexpr (S == Storage::kFloat) {
    float* dst = static_cast<float*>(base) + begin;
    for (int64_t j = 0; j < n; ++j) dst[j] = in[j];
  } else {
    uint16_t* dst = static_cast<uint16_t*>(base) + begin;
    if (!stochastic) {
      for (int64_t j = 0; j < n; ++j) dst[j] = round_to_storage<S>(in[j], 0u, false);
      return;
    }
    for (int64_t j = 0; j < n; j += 4) {
      const PhiloxWords words =
          philox_block(seed, offset, stream_block(stream, static_cast<uint64_t>(begin + j)));
      const int64_t lanes = n - j < 4 ? n - j : 4;
      for (int64_t l = 0; l < lanes; ++l) dst[j + l] = round_to_storage<S>(in[j + l], words.w[l], true);
    }
  }
}

template <Storage P, Storage S>
void adamw_cpu(const AdamWArgs& a) {
  struct Chunk {
    int64_t tensor, begin, end;
  };
  std::vector<Chunk> chunks;
  for (int64_t t = 0; t < static_cast<int64_t>(a.numel.size()); ++t) {
    for (int64_t b = 0; b < a.numel[t]; b += kChunk) {
      chunks.push_back({t, b, std::min(a.numel[t], b + kChunk)});
    }
  }
  at::parallel_for(0, static_cast<int64_t>(chunks.size()), 1, [&](int64_t first, int64_t last) {
    float p[kBlock], g[kBlock], m[kBlock], v[kBlock];
    for (int64_t c = first; c < last; ++c) {
      const Chunk& chunk = chunks[c];
      const int64_t t = chunk.tensor;
      const float neg_step_size = a.neg_step_size[t], bc2_sqrt = a.bc2_sqrt[t];
      const uint64_t stream = 3 * static_cast<uint64_t>(t);
      for (int64_t b = chunk.begin; b < chunk.end; b += kBlock) {
        const int64_t n = std::min(kBlock, chunk.end - b);
        load<P>(a.params[t], b, n, p);
        load<P>(a.grads[t], b, n, g);
        load<S>(a.exp_avgs[t], b, n, m);
        load<S>(a.exp_avg_sqs[t], b, n, v);
        if constexpr (S == Storage::kHalf) {
          for (int64_t j = 0; j < n; ++j) v[j] = decode_fourth_root(v[j]);
        }
        for (int64_t j = 0; j < n; ++j) adamw_update(p[j], g[j], m[j], v[j], a.hyper, neg_step_size, bc2_sqrt);
        if constexpr (S == Storage::kHalf) {
          for (int64_t j = 0; j < n; ++j) v[j] = encode_fourth_root(v[j]);
        }
        store<P>(a.params[t], b, n, p, a.stochastic, a.seed, a.offset, stream + 0);
        store<S>(a.exp_avgs[t], b, n, m, a.stochastic, a.seed, a.offset, stream + 1);
        store<S>(a.exp_avg_sqs[t], b, n, v, a.stochastic, a.seed, a.offset, stream + 2);
      }
    }
  });
}

void adamw_step_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                    at::TensorList exp_avg_sqs, at::IntArrayRef steps, double lr, double beta1,
                    double beta2, double eps, double weight_decay, bool maximize,
                    bool stochastic_rounding, int64_t seed, int64_t offset) {
  const AdamWArgs a = make_adamw_args(params, grads, exp_avgs, exp_avg_sqs, steps, lr, beta1, beta2,
                                      eps, weight_decay, maximize, stochastic_rounding, seed, offset,
                                      at::kCPU);
  dispatch_storage(a.param_storage, a.state_storage, [&](auto p, auto s) {
    adamw_cpu<decltype(p)::value, decltype(s)::value>(a);
  });
}

}  // namespace
}  // namespace clipshard

TORCH_LIBRARY_IMPL(clipshard, CPU, m) { m.impl("adamw_step_", &clipshard::adamw_step_cpu); }
