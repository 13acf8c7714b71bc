// Runs the CUDA kernel of csrc/cuda/siglip_kernels.cuh on the host through emulate_cuda.h and
// compares it with a double-precision reference of the same maths: the loss-only pass and the
// gradient pass with fp32, fp16 (prescaled) and bf16 logit gradients, over several column chunks,
// with positives and without (a block of the SigLIP ring from another rank), and the kernel with
// labels by sample id (siglip_ids_chunk_kernel: same-id pairs +1 or dropped), whose results with ids
// that match only at the positives must be bit-equal to the kernel without ids.
// Build: g++ -std=c++20 -O1 -pthread -I<repo>/csrc/cuda -I<repo>/csrc/include -I<torch>/include emulate_siglip.cpp
// Prints one line per case and exits non-zero on any mismatch. Usage: emulate_siglip [CASE INDEX]
#include "emulate_cuda.h"
// The kernels and siglip.cu's launch of them (siglip_launch.h), compiled as host code:
#include "fp16_prescale.cuh"
#include "siglip_launch.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <limits>
#include <random>
#include <type_traits>
#include <vector>

namespace k = clipshard::siglip_cuda;

// pos_offset of a block without positives, as csrc/siglip_args.h passes it to the kernel.
constexpr int64_t kNoPositives = std::numeric_limits<int64_t>::min() / 2;

enum class Ids { kNone, kMulti, kMask };  // no ids; same-id pairs +1; same-id pairs dropped

struct Case {
  int64_t M, K, width, pos_offset;  // columns processed in chunks of `width`
  float scale, bias, prescale;
  bool has_bias, nan_dot;           // nan_dot: one similarity of row 1 is NaN (with ids "mask" also one
                                    // of row 2 Inf: in pairs that are dropped when all ids are equal)
  Ids ids = Ids::kNone;
  int64_t distinct_ids = 0;         // ids drawn from [0, distinct_ids) (1: all equal)
  int rows_per_cta = 0;             // of the kernel with ids; 0: the launch rule's choice on 1 SM
};

static const char* ids_name(Ids ids) { return ids == Ids::kNone ? "" : ids == Ids::kMulti ? " ids-multi" : " ids-mask"; }

// Rows per CTA of the kernel with ids: the case's, or what siglip.cu's rule picks on a 1-SM device.
static int rows_per_cta(const Case& c) {
  return c.rows_per_cta ? c.rows_per_cta : clipshard::launch_rules::siglip_ids_rows_per_cta(c.M, 1, k::kIdRows);
}

// The kernel's outputs over all chunks: per-row sums and the M x K logit gradients.
template <typename DL>
struct Outputs {
  std::vector<double> loss, grad_scale, grad_bias;
  std::vector<DL> dlogits;
};

// Runs the kernel (with ids: siglip_ids_chunk_kernel) over the column chunks of `dots`.
template <typename DL, bool kGrad>
static Outputs<DL> run_kernel(const Case& c, const std::vector<float>& dots, const std::vector<int64_t>& row_ids,
                              const std::vector<int64_t>& col_ids, bool with_ids) {
  const int64_t M = c.M, K = c.K;
  Outputs<DL> out{std::vector<double>(M, 0.0), std::vector<double>(M, 0.0), std::vector<double>(M, 0.0),
                  std::vector<DL>(M * K)};
  const float* bias = c.has_bias ? &c.bias : nullptr;
  const float* prescale = c.prescale != 1.0f ? &c.prescale : nullptr;
  for (int64_t begin = 0; begin < K; begin += c.width) {
    const int64_t width = std::min(c.width, K - begin);
    std::vector<float> chunk(M * width);  // the driver's contiguous M x width workspace
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < width; ++j) chunk[i * width + j] = dots[i * K + begin + j];
    std::vector<DL> chunk_dl(M * width);
    k::ChunkParams<DL> p{chunk.data(), kGrad ? chunk_dl.data() : nullptr, M, width, begin, c.pos_offset,
                         &c.scale, bias, prescale, out.loss.data(), out.grad_scale.data(), out.grad_bias.data()};
    const k::ChunkIds ids{with_ids ? row_ids.data() : nullptr, with_ids ? col_ids.data() : nullptr,
                          c.ids == Ids::kMask, rows_per_cta(c)};
    k::launch_chunk<DL, kGrad>(p, ids, [](auto kernel, dim3 grid, const auto& params) {
      emulate_launch(kernel, grid, k::kThreads, params);
    });
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < width; ++j) out.dlogits[i * K + begin + j] = chunk_dl[i * width + j];
  }
  return out;
}

static bool close(double got, double want, double rtol, double atol, const char* what, int64_t index) {
  if (std::isnan(want) ? std::isnan(got) : std::fabs(got - want) <= atol + rtol * std::fabs(want)) return true;
  std::printf("  MISMATCH %s[%lld]: got %.9g, want %.9g\n", what, static_cast<long long>(index), got, want);
  return false;
}

template <typename DL>
static const char* name() {
  if constexpr (std::is_same_v<DL, float>) return "fp32";
  if constexpr (std::is_same_v<DL, c10::Half>) return "fp16";
  return "bf16";
}

// DL = float with kGrad = false is the loss-only pass.
template <typename DL, bool kGrad>
static bool run_case(const Case& c, std::mt19937& gen) {
  const int64_t M = c.M, K = c.K;
  std::normal_distribution<float> normal(0.f, 0.4f);
  std::vector<float> dots(M * K);
  for (auto& v : dots) v = normal(gen);
  if (c.nan_dot) dots[1 * K + K / 2] = NAN;
  if (c.nan_dot && c.ids == Ids::kMask) dots[2 * K + K / 3] = INFINITY;
  std::vector<int64_t> row_ids(M), col_ids(K);
  if (c.ids != Ids::kNone) {
    std::uniform_int_distribution<int64_t> draw(0, c.distinct_ids - 1);
    for (auto& v : row_ids) v = draw(gen);
    for (auto& v : col_ids) v = draw(gen);
  }
  const Outputs<DL> out = run_kernel<DL, kGrad>(c, dots, row_ids, col_ids, c.ids != Ids::kNone);
  const std::vector<double>&loss = out.loss, &grad_scale = out.grad_scale, &grad_bias = out.grad_bias;
  const std::vector<DL>& dlogits = out.dlogits;

  bool ok = true;
  const double s = c.scale, b = c.has_bias ? c.bias : 0.0;
  // The dlogits dtype's rounding (relative). fp16: the prescale 2^k > 2^13 / |s| keeps s * dl
  // normal down to dl ~ 2^-27 (7e-9) and leaves half a subnormal step of at most |s| * 2^-38 below
  // that (without it, the step would be 6e-8 for every scale).
  const double dl_rtol = std::is_same_v<DL, float> ? 1e-6 : std::is_same_v<DL, c10::Half> ? 5e-4 : 4e-3;
  const double dl_atol = std::is_same_v<DL, c10::Half> ? std::fabs(s) * std::exp2(-38.0) : 1e-30;
  for (int64_t i = 0; i < M; ++i) {
    double want_loss = 0, want_scale = 0, want_bias = 0;
    for (int64_t j = 0; j < K; ++j) {
      // the label rule of siglip_forward: +1 for the positive; same id: +1 or no term; else -1
      const bool positive = j == c.pos_offset + i, same = c.ids != Ids::kNone && row_ids[i] == col_ids[j];
      const bool dropped = same && !positive && c.ids == Ids::kMask;
      const double dot = dots[i * K + j], z = positive || same ? 1.0 : -1.0;
      const double t = -z * (s * dot + b);
      const double e = std::exp(-std::fabs(t));
      if (dropped) {  // no term at all, whatever its dot (an Inf or NaN there leaves no trace)
        if (kGrad) ok &= close(static_cast<float>(dlogits[i * K + j]), 0.0, 0.0, 0.0, "dlogits", i * K + j);
        if (!ok) return false;
        continue;
      }
      const double dl = -z * (t >= 0 ? 1.0 : e) / (1.0 + e);
      want_loss += std::max(t, 0.0) + std::log1p(e);
      want_scale += dl * dot;
      want_bias += dl;
      if (kGrad) {
        const double got = static_cast<float>(dlogits[i * K + j]) / c.prescale;
        // The kernel's fp32 logit is off by up to an ulp of |l|, which moves dl by that much relative.
        const double rtol = dl_rtol + 1.2e-7 * std::fabs(s * dot + b);
        ok &= close(got, s * dl, rtol, dl_atol, "dlogits", i * K + j);
        if (!ok) return false;
      }
    }
    ok &= close(loss[i], want_loss, 2e-6, 1e-30, "row loss", i);
    if (kGrad) {
      ok &= close(grad_scale[i], want_scale, 2e-6, 2e-6 * K, "row grad_scale", i);
      ok &= close(grad_bias[i], want_bias, 2e-6, 2e-6 * K, "row grad_bias", i);
    }
    if (!ok) return false;
  }
  std::printf("ok %s %s M=%lld K=%lld width=%lld scale=%g bias=%s nan=%d%s%s\n", kGrad ? "grad" : "loss",
              name<DL>(), static_cast<long long>(M), static_cast<long long>(K), static_cast<long long>(c.width),
              c.scale, c.has_bias ? "yes" : "no", c.nan_dot ? 1 : 0,
              c.pos_offset == kNoPositives ? " no-positives" : "", ids_name(c.ids));
  return ok;
}

template <typename T>
static bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

// Ids that match only at the positives (row i: pos_offset + i; column j: j): the kernel with ids
// gives the bits of the kernel without them.
template <typename DL, bool kGrad>
static bool run_distinct_ids_case(const Case& c, std::mt19937& gen) {
  std::normal_distribution<float> normal(0.f, 0.4f);
  std::vector<float> dots(c.M * c.K);
  for (auto& v : dots) v = normal(gen);
  std::vector<int64_t> row_ids(c.M), col_ids(c.K);
  for (int64_t i = 0; i < c.M; ++i) row_ids[i] = c.pos_offset + i;
  for (int64_t j = 0; j < c.K; ++j) col_ids[j] = j;
  const Outputs<DL> plain = run_kernel<DL, kGrad>(c, dots, row_ids, col_ids, false);
  const Outputs<DL> with_ids = run_kernel<DL, kGrad>(c, dots, row_ids, col_ids, true);
  const bool ok = same_bits(plain.loss, with_ids.loss) && same_bits(plain.grad_scale, with_ids.grad_scale) &&
                  same_bits(plain.grad_bias, with_ids.grad_bias) && same_bits(plain.dlogits, with_ids.dlogits);
  std::printf("%s %s %s distinct ids bit-equal to no ids (%d rows per CTA)\n", ok ? "ok" : "  MISMATCH",
              kGrad ? "grad" : "loss", name<DL>(), rows_per_cta(c));
  return ok;
}

// Without arguments every case runs; with one, only the case of that index.
int main(int argc, char** argv) {
  std::mt19937 gen(1234);
  // M, K, width, pos_offset, scale, bias, prescale, has_bias, nan_dot
  const Case cases[] = {
      {5, 700, 256, 300, 10.f, -10.f, 1.f, true, false},   // positives in the second chunk, ragged last chunk
      {3, 300, 300, 0, 100.f, 20.f, 1.f, true, false},     // one chunk wider than the CTA, extreme logits
      {7, 257, 128, 250, 1.f, 0.f, 1.f, false, false},     // positives in the last, one-column-wide chunk
      {4, 513, 512, 100, 30.f, -5.f, 1.f, true, true},     // a NaN similarity: row 1 all NaN
      {3, 300, 128, kNoPositives, 10.f, -10.f, 1.f, true, false},  // no positives: every pair a negative
      // labels by id: the launch rule's 4 rows per CTA (13 rows on 1 SM), a partial last CTA of rows
      // (13 = 3 x 4 + 1), ~1 in 20 pairs same-id, ragged chunks
      {13, 700, 256, 300, 10.f, -10.f, 1.f, true, false, Ids::kMulti, 20},
      {13, 700, 256, 300, 10.f, -10.f, 1.f, true, false, Ids::kMask, 20, 3},  // 3 rows per CTA
      // all ids equal: only the positives; a NaN and an Inf similarity in dropped pairs
      {5, 300, 128, 0, 30.f, -5.f, 1.f, true, true, Ids::kMask, 1},
      {9, 300, 128, 0, 100.f, 20.f, 1.f, false, false, Ids::kMulti, 1},  // all ids equal: every pair +1
      {9, 300, 128, kNoPositives, 10.f, -10.f, 1.f, true, false, Ids::kMask, 7},  // ids without positives
  };
  bool ok = true;
  for (int n = 0; n < static_cast<int>(std::size(cases)); ++n) {
    if (argc > 1 && n != std::atoi(argv[1])) continue;
    const Case& c = cases[n];
    ok &= run_case<float, false>(c, gen);
    ok &= run_case<float, true>(c, gen);
    ok &= run_case<c10::BFloat16, true>(c, gen);
    Case fp16 = c;
    fp16.prescale = clipshard::fp16_prescale::prescale_for_bound(std::fabs(c.scale));  // as siglip.cu
    ok &= run_case<c10::Half, true>(fp16, gen);
  }
  if (argc == 1) {
    for (const int rows : {k::kIdRows, 1}) {
      const Case distinct{11, 513, 256, 100, 10.f, -10.f, 1.f, true, false, Ids::kMulti, 0, rows};
      ok &= run_distinct_ids_case<float, false>(distinct, gen);
      ok &= run_distinct_ids_case<float, true>(distinct, gen);
      ok &= run_distinct_ids_case<c10::BFloat16, true>(distinct, gen);
      Case fp16 = distinct;
      fp16.prescale = clipshard::fp16_prescale::prescale_for_bound(std::fabs(distinct.scale));
      ok &= run_distinct_ids_case<c10::Half, true>(fp16, gen);
    }
  }
  std::printf(ok ? "ALL OK\n" : "FAILED\n");
  return ok ? 0 : 1;
}
