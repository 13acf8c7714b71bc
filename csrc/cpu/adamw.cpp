// CPU kernel of clipshard::adamw_step_: one parallel pass over all elements of all tensors.
// Elements are processed in blocks of kBlock: load and widen to fp32, update (4 lanes at a time
// with SSE on x86, the shared scalar code elsewhere and for tails), then narrow and store, drawing
// Philox words for the 16-bit outputs. x86-64's baseline has no FMA, so nothing is contracted.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>
#if defined(__SSE2__)
#include <immintrin.h>
#endif

#include "clipshard/adamw.h"
#include "clipshard/philox.h"
#include "../adamw_args.h"

namespace clipshard {
namespace {

constexpr int64_t kBlock = 256;           // elements per inner block (a multiple of 4)
constexpr int64_t kChunk = 64 * kBlock;   // elements per parallel work item

#if defined(__SSE2__)
// Four lanes of adamw_update (clipshard/adamw.h) with SSE: the same IEEE-rounded operations in the
// same order, hence the same bits. GCC does not vectorise the scalar loop itself: sqrt may set errno.
inline void adamw_update4(float* p, const float* g, float* m, float* v, const AdamWHyper& h,
                          float neg_step_size, float bc2_sqrt) {
  __m128 gv = _mm_loadu_ps(g);
  if (h.maximize) gv = _mm_xor_ps(gv, _mm_set1_ps(-0.0f));  // exact negation
  __m128 pv = _mm_mul_ps(_mm_loadu_ps(p), _mm_set1_ps(h.decay));
  __m128 mv = _mm_loadu_ps(m);
  mv = _mm_add_ps(mv, _mm_mul_ps(_mm_set1_ps(h.one_minus_beta1), _mm_sub_ps(gv, mv)));
  const __m128 vv = _mm_add_ps(_mm_mul_ps(_mm_loadu_ps(v), _mm_set1_ps(h.beta2)),
                               _mm_mul_ps(_mm_mul_ps(_mm_set1_ps(h.one_minus_beta2), gv), gv));
  const __m128 denom = _mm_add_ps(_mm_div_ps(_mm_sqrt_ps(vv), _mm_set1_ps(bc2_sqrt)), _mm_set1_ps(h.eps));
  pv = _mm_add_ps(pv, _mm_div_ps(_mm_mul_ps(_mm_set1_ps(neg_step_size), mv), denom));
  _mm_storeu_ps(p, pv);
  _mm_storeu_ps(m, mv);
  _mm_storeu_ps(v, vv);
}
#endif

// Updates n elements held in fp32 arrays.
inline void update_block(float* p, const float* g, float* m, float* v, int64_t n, const AdamWHyper& h,
                         float neg_step_size, float bc2_sqrt) {
  int64_t j = 0;
#if defined(__SSE2__)
  for (; j + 4 <= n; j += 4) adamw_update4(p + j, g + j, m + j, v + j, h, neg_step_size, bc2_sqrt);
#endif
  for (; j < n; ++j) adamw_update(p[j], g[j], m[j], v[j], h, neg_step_size, bc2_sqrt);
}

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

// The Philox words of `blocks` consecutive blocks starting at counter `first_block` (integer-only
// code, so the instruction-set clones cannot change a bit).
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
__attribute__((target_clones("avx2", "default")))
#endif
void draw_words(uint64_t seed, uint64_t offset, uint64_t first_block, int64_t blocks, uint32_t* random) {
  for (int64_t b = 0; b < blocks; ++b) {
    const PhiloxWords words = philox_block(seed, offset, first_block + static_cast<uint64_t>(b));
    for (int l = 0; l < 4; ++l) random[4 * b + l] = words.w[l];
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
    uint32_t random[kBlock];  // the Philox words first (a loop of its own), then the rounding
    draw_words(seed, offset, stream_block(stream, static_cast<uint64_t>(begin)), (n + 3) / 4, random);
    for (int64_t j = 0; j < n; ++j) dst[j] = round_to_storage<S>(in[j], random[j], true);
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
        update_block(p, g, m, v, n, a.hyper, neg_step_size, bc2_sqrt);
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
