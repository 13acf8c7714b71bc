// CPU kernel of clipshard::adamw_step_: one parallel pass over all elements of all tensors.
//
// Per block of 512 elements, four vectorised passes (docs/optimizer.md, "Kernels"):
// - Philox words for each stochastically rounded 16-bit output, 16 (AVX-512) or 8 (AVX2) Philox
//   blocks at a time with integer intrinsics (philox_simd.h), one block serving 4 elements;
// - widen p, g, m, v to fp32 arrays (a plain loop over the shared header functions);
// - the update, with SSE / AVX2 / AVX-512 intrinsics performing the header's IEEE operations in
//   the header's order (GCC does not vectorise the scalar code: sqrt may set errno);
// - narrow with the shared rounding rules and store (a plain loop again).
// The whole block step is compiled once per instruction set and picked at run time; with FMA
// contraction off, every copy gives the bits of the scalar header code and of the CUDA kernel.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#if defined(__GNUC__) && !defined(__clang__)
// For every function below, including the inline header functions (so that they stay inlinable):
// no a*b+c contraction into FMAs, which the AVX-512 code could otherwise do and which would change
// bits; and no floating-point exception flags to preserve, so that the fp16 decoding's selects may
// be computed unconditionally and vectorised (values are unchanged: IEEE results do not depend on
// the flags).
#pragma GCC optimize("fp-contract=off", "no-trapping-math")
#endif

#include "clipshard/adamw.h"
#include "clipshard/philox.h"
#include "philox_simd.h"
#include "../adamw_args.h"

namespace clipshard {
namespace {

constexpr int64_t kBlock = 512;           // elements per inner block (a multiple of 4)
constexpr int64_t kChunk = 32 * kBlock;   // elements per parallel work item

template <Storage S>
__attribute__((always_inline)) inline float load_one(const void* base, int64_t i) {
  if constexpr (S == Storage::kFloat) {
    return static_cast<const float*>(base)[i];
  } else {
    return storage_to_float<S>(static_cast<const uint16_t*>(base)[i]);
  }
}

// Stores element i; random[j] is its Philox word (read only when rounding stochastically to 16 bits).
template <Storage S, bool kStochastic>
__attribute__((always_inline)) inline void store_one(void* base, int64_t i, float x, const uint32_t* random,
                                                     int64_t j) {
  if constexpr (S == Storage::kFloat) {
    static_cast<float*>(base)[i] = canonical_float(x);
  } else {
    static_cast<uint16_t*>(base)[i] = round_to_storage<S>(x, kStochastic ? random[j] : 0u, kStochastic);
  }
}

// The update of n elements held in fp32 arrays (v: the decoded second moment). kFourthRoot: v is
// written back encoded as v^(1/4) = sqrt(sqrt(v)), reusing the sqrt(v) of the denominator. The
// scalar code is the shared header's; the vector versions below do the same IEEE operations in the
// same order (GCC does not vectorise the scalar code: sqrt may set errno).
template <bool kFourthRoot>
inline void update_scalar(float* p, const float* g, float* m, float* v, int64_t begin, int64_t n,
                          const AdamWHyper& h, float neg_step_size, float bc2_sqrt) {
  for (int64_t j = begin; j < n; ++j) {
    adamw_update(p[j], g[j], m[j], v[j], h, neg_step_size, bc2_sqrt);
    if constexpr (kFourthRoot) v[j] = encode_fourth_root(v[j]);
  }
}

#if defined(CLIPSHARD_PHILOX_SIMD)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12, inside its AVX-512 intrinsics
__attribute__((target("avx512f"))) inline __m512 xor512(__m512 a, __m512 b) {  // _mm512_xor_ps needs DQ
  return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a), _mm512_castps_si512(b)));
}

// One body for three vector widths: the vector type and the intrinsics differ, the operations and
// their order do not.
#define CLIPSHARD_ADAMW_VECTOR_UPDATE(TARGET, NAME, WIDTH, VEC, LOAD, STORE, SET1, XOR, ADD, SUB, MUL, DIV, SQRT) \
  template <bool kFourthRoot>                                                                            \
  __attribute__((target(TARGET))) void NAME(float* p, const float* g, float* m, float* v, int64_t n,     \
                                            const AdamWHyper& h, float neg_step_size, float bc2_sqrt) {  \
    const VEC sign = SET1(h.maximize ? -0.0f : 0.0f), decay = SET1(h.decay);                             \
    const VEC one_minus_beta1 = SET1(h.one_minus_beta1), beta2 = SET1(h.beta2);                          \
    const VEC one_minus_beta2 = SET1(h.one_minus_beta2), eps = SET1(h.eps);                              \
    const VEC step = SET1(neg_step_size), bc2 = SET1(bc2_sqrt);                                          \
    int64_t j = 0;                                                                                       \
    for (; j + WIDTH <= n; j += WIDTH) {                                                                 \
      const VEC gv = XOR(LOAD(g + j), sign); /* exact negation when maximizing */                        \
      VEC pv = MUL(LOAD(p + j), decay);                                                                  \
      VEC mv = LOAD(m + j);                                                                              \
      mv = ADD(mv, MUL(one_minus_beta1, SUB(gv, mv)));                                                   \
      const VEC vv = ADD(MUL(LOAD(v + j), beta2), MUL(MUL(one_minus_beta2, gv), gv));                    \
      const VEC root = SQRT(vv);                                                                         \
      pv = ADD(pv, DIV(MUL(step, mv), ADD(DIV(root, bc2), eps)));                                        \
      STORE(p + j, pv);                                                                                  \
      STORE(m + j, mv);                                                                                  \
      STORE(v + j, kFourthRoot ? SQRT(root) : vv);                                                       \
    }                                                                                                    \
    update_scalar<kFourthRoot>(p, g, m, v, j, n, h, neg_step_size, bc2_sqrt);                            \
  }
CLIPSHARD_ADAMW_VECTOR_UPDATE("avx512f", update_avx512, 16, __m512, _mm512_loadu_ps, _mm512_storeu_ps,
                              _mm512_set1_ps, xor512, _mm512_add_ps, _mm512_sub_ps, _mm512_mul_ps,
                              _mm512_div_ps, _mm512_sqrt_ps)
CLIPSHARD_ADAMW_VECTOR_UPDATE("avx2", update_avx2, 8, __m256, _mm256_loadu_ps, _mm256_storeu_ps,
                              _mm256_set1_ps, _mm256_xor_ps, _mm256_add_ps, _mm256_sub_ps, _mm256_mul_ps,
                              _mm256_div_ps, _mm256_sqrt_ps)
CLIPSHARD_ADAMW_VECTOR_UPDATE("sse2", update_sse2, 4, __m128, _mm_loadu_ps, _mm_storeu_ps, _mm_set1_ps,
                              _mm_xor_ps, _mm_add_ps, _mm_sub_ps, _mm_mul_ps, _mm_div_ps, _mm_sqrt_ps)
#undef CLIPSHARD_ADAMW_VECTOR_UPDATE
#pragma GCC diagnostic pop
#endif

template <bool kFourthRoot>
void update_block(float* p, const float* g, float* m, float* v, int64_t n, const AdamWHyper& h,
                  float neg_step_size, float bc2_sqrt) {
#if defined(CLIPSHARD_PHILOX_SIMD)
  switch (simd_isa()) {
    case SimdIsa::kAvx512: return update_avx512<kFourthRoot>(p, g, m, v, n, h, neg_step_size, bc2_sqrt);
    case SimdIsa::kAvx2: return update_avx2<kFourthRoot>(p, g, m, v, n, h, neg_step_size, bc2_sqrt);
    case SimdIsa::kBaseline: return update_sse2<kFourthRoot>(p, g, m, v, n, h, neg_step_size, bc2_sqrt);
  }
#endif
  update_scalar<kFourthRoot>(p, g, m, v, 0, n, h, neg_step_size, bc2_sqrt);
}

// The pointers and scalars of one tensor.
struct TensorStep {
  void* p;
  const void* g;
  void* m;
  void* v;
  float neg_step_size, bc2_sqrt;
  uint64_t stream;      // 3 * tensor number: the stream of the parameter; + 1, + 2 for the moments
  uint64_t index_base;  // global index of element 0 (any value: a shard may start mid Philox block)
};

// Elements [begin, end) of one tensor, in blocks of kBlock: the Philox words of the block for each
// stochastically rounded output, a widening loop, the update, and a narrowing loop (the two loops
// vectorise in the AVX2 / AVX-512 clones). Local element b + j has global index
// index_base + b + j and takes word (index_base + b) % 4 + j of the words generated from Philox
// block (index_base + b) / 4 on: one block more than kBlock / 4 when the start is not aligned.
template <Storage P, Storage S, bool kStochastic>
__attribute__((always_inline)) inline void step_range(const TensorStep& t, int64_t begin, int64_t end,
                                                      const AdamWHyper& h, uint64_t seed,
                                                      uint64_t offset) {
  alignas(64) uint32_t rp[kBlock + 4], rm[kBlock + 4], rv[kBlock + 4];
  alignas(64) float p[kBlock], g[kBlock], m[kBlock], v[kBlock];
  void* const p_base = t.p;
  const void* const g_base = t.g;
  void* const m_base = t.m;
  void* const v_base = t.v;
  for (int64_t b = begin; b < end; b += kBlock) {
    const int64_t n = std::min(kBlock, end - b);
    int64_t lead = 0;  // words of the first Philox block that belong to elements before b
    if constexpr (kStochastic) {
      const uint64_t global = t.index_base + static_cast<uint64_t>(b);
      const uint64_t first = global >> 2;
      lead = static_cast<int64_t>(global & 3u);
      const int64_t blocks = (lead + n + 3) / 4;
      if constexpr (P != Storage::kFloat) philox_words(seed, offset, stream_block(t.stream, 0) + first, blocks, rp);
      if constexpr (S != Storage::kFloat) {
        philox_words(seed, offset, stream_block(t.stream + 1, 0) + first, blocks, rm);
        philox_words(seed, offset, stream_block(t.stream + 2, 0) + first, blocks, rv);
      }
    }
    // omp simd: GCC 12 if-converts the fp16 rules' many-way selects only in loops marked for SIMD.
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) {
      p[j] = load_one<P>(p_base, b + j);
      g[j] = load_one<P>(g_base, b + j);
      m[j] = load_one<S>(m_base, b + j);
      v[j] = load_one<S>(v_base, b + j);
      if constexpr (S == Storage::kHalf) v[j] = decode_fourth_root(v[j]);
    }
    update_block<S == Storage::kHalf>(p, g, m, v, n, h, t.neg_step_size, t.bc2_sqrt);
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) {
      store_one<P, kStochastic>(p_base, b + j, p[j], rp, lead + j);
      store_one<S, kStochastic>(m_base, b + j, m[j], rm, lead + j);
      store_one<S, kStochastic>(v_base, b + j, v[j], rv, lead + j);
    }
  }
}

template <Storage P, Storage S>
__attribute__((always_inline)) inline void step_range_rounding(const TensorStep& t, int64_t begin, int64_t end,
                                                               const AdamWHyper& h, bool stochastic,
                                                               uint64_t seed, uint64_t offset) {
  if (stochastic && (P != Storage::kFloat || S != Storage::kFloat)) {
    step_range<P, S, true>(t, begin, end, h, seed, offset);
  } else {
    step_range<P, S, false>(t, begin, end, h, seed, offset);
  }
}

template <Storage P>
__attribute__((always_inline)) inline void step_range_param(const TensorStep& t, int64_t begin, int64_t end,
                                                            const AdamWHyper& h, Storage state, bool stochastic,
                                                            uint64_t seed, uint64_t offset) {
  switch (state) {
    case Storage::kFloat: return step_range_rounding<P, Storage::kFloat>(t, begin, end, h, stochastic, seed, offset);
    case Storage::kHalf: return step_range_rounding<P, Storage::kHalf>(t, begin, end, h, stochastic, seed, offset);
    case Storage::kBFloat16:
      return step_range_rounding<P, Storage::kBFloat16>(t, begin, end, h, stochastic, seed, offset);
  }
}

// Elements [begin, end) of one tensor with any storage and rounding.
__attribute__((always_inline)) inline void step_range_any(const TensorStep& t, int64_t begin, int64_t end,
                                                          const AdamWHyper& h, Storage param, Storage state,
                                                          bool stochastic, uint64_t seed, uint64_t offset) {
  switch (param) {
    case Storage::kFloat: return step_range_param<Storage::kFloat>(t, begin, end, h, state, stochastic, seed, offset);
    case Storage::kHalf: return step_range_param<Storage::kHalf>(t, begin, end, h, state, stochastic, seed, offset);
    case Storage::kBFloat16:
      return step_range_param<Storage::kBFloat16>(t, begin, end, h, state, stochastic, seed, offset);
  }
}

// One copy per instruction set, everything above inlined into each (flatten: a lambda or a plain
// call would be compiled for the baseline only). With FMA contraction off, the copies perform the
// same rounded fp32 operations; only the width of the widening/narrowing loops differs.
#define CLIPSHARD_STEP_RANGE(NAME, ATTRIBUTES)                                                              \
  ATTRIBUTES void NAME(const TensorStep& t, int64_t begin, int64_t end, const AdamWHyper& h, Storage param, \
                       Storage state, bool stochastic, uint64_t seed, uint64_t offset) {                    \
    step_range_any(t, begin, end, h, param, state, stochastic, seed, offset);                               \
  }
CLIPSHARD_STEP_RANGE(step_range_baseline, __attribute__((flatten)))
#if defined(CLIPSHARD_PHILOX_SIMD)
CLIPSHARD_STEP_RANGE(step_range_avx2, __attribute__((target("avx2"), flatten)))
CLIPSHARD_STEP_RANGE(step_range_avx512, __attribute__((target("avx512f"), flatten)))
#endif
#undef CLIPSHARD_STEP_RANGE

void step_range_dispatch(const TensorStep& t, int64_t begin, int64_t end, const AdamWHyper& h,
                         Storage param, Storage state, bool stochastic, uint64_t seed, uint64_t offset) {
#if defined(CLIPSHARD_PHILOX_SIMD)
  switch (simd_isa()) {
    case SimdIsa::kAvx512: return step_range_avx512(t, begin, end, h, param, state, stochastic, seed, offset);
    case SimdIsa::kAvx2: return step_range_avx2(t, begin, end, h, param, state, stochastic, seed, offset);
    case SimdIsa::kBaseline: break;
  }
#endif
  step_range_baseline(t, begin, end, h, param, state, stochastic, seed, offset);
}

void adamw_cpu(const AdamWArgs& a) {
  struct Chunk {
    int64_t tensor, begin, end;
  };
  std::vector<TensorStep> tensors;
  std::vector<Chunk> chunks;
  for (int64_t t = 0; t < static_cast<int64_t>(a.numel.size()); ++t) {
    tensors.push_back({a.params[t], a.grads[t], a.exp_avgs[t], a.exp_avg_sqs[t], a.neg_step_size[t],
                       a.bc2_sqrt[t], a.stream[t], static_cast<uint64_t>(a.index_base[t])});
    for (int64_t b = 0; b < a.numel[t]; b += kChunk) {
      chunks.push_back({t, b, std::min(a.numel[t], b + kChunk)});
    }
  }
  at::parallel_for(0, static_cast<int64_t>(chunks.size()), 1, [&](int64_t first, int64_t last) {
    for (int64_t c = first; c < last; ++c) {
      const Chunk& chunk = chunks[c];
      step_range_dispatch(tensors[chunk.tensor], chunk.begin, chunk.end, a.hyper, a.param_storage,
                          a.state_storage, a.stochastic, a.seed, a.offset);
    }
  });
}

void adamw_step_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                    at::TensorList exp_avg_sqs, at::IntArrayRef steps, double lr, double beta1,
                    double beta2, double eps, double weight_decay, bool maximize,
                    bool stochastic_rounding, int64_t seed, int64_t offset,
                    at::OptionalIntArrayRef tensor_numbers, at::OptionalIntArrayRef index_bases) {
  const AdamWArgs a = make_adamw_args(params, grads, exp_avgs, exp_avg_sqs, steps, lr, beta1, beta2,
                                      eps, weight_decay, maximize, stochastic_rounding, seed, offset,
                                      tensor_numbers, index_bases, at::kCPU);
  adamw_cpu(a);
}

}  // namespace
}  // namespace clipshard

TORCH_LIBRARY_IMPL(clipshard, CPU, m) { m.impl("adamw_step_", &clipshard::adamw_step_cpu); }
