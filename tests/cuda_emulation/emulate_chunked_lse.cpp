// Runs the chunked path's CUDA kernels (csrc/cuda/contrastive_lse_chunked_kernels.cuh and
// fp16_prescale.cuh) on the host through emulate_cuda.h, driven chunk by chunk as
// contrastive_lse_chunked.cu drives them on an H200 (both forward variants: 32 and 16 rows per CTA; as
// many column splits as its rule in launch_rules.h picks there, up to 8 here) (the GEMMs computed here in double and
// rounded to fp32, as cuBLAS with fp32 output would), and compares every output with a
// double-precision reference. Cases with sample ids (duplicates, all equal) and without positives
// (pos -1, launched with the pos_offset that contrastive_lse.cu's rule in launch_rules.h gives) run
// the kernels' kIds variants.
// Build: g++ -std=c++20 -O1 -pthread -I<repo>/csrc/cuda -I<repo>/csrc/include -I<torch>/include
// Prints one line per case and exits non-zero on any mismatch. Usage: emulate_chunked_lse [CASE INDEX]
#include "emulate_cuda.h"
// The kernels, compiled as host code, and the launch rules of contrastive_lse{,_chunked}.cu:
#include "clipshard/launch_rules.h"
#include "contrastive_lse_chunked_kernels.cuh"
#include "fp16_prescale.cuh"
#include "lse_reference.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <iterator>
#include <random>
#include <type_traits>

constexpr int64_t kH200Sms = 132;  // streaming multiprocessors of the GPU whose launches are emulated

namespace k = clipshard::chunked_cuda;

struct Case {
  int64_t M, K, D, pos, kc;
  float scale, bias;
  bool has_col;
  bool nan_row;    // a NaN in row 1
  bool realistic;  // upstream gradients of a real loss: 0.5 / 65536 per row and column
  bool two_splits = false;  // at most 2 column splits instead of an H200's (emulation time: see main)
  int ids = 0;              // sample ids: kNoIds, kDuplicateIds or kEqualIds
};
constexpr int kNoIds = 0, kDuplicateIds = 1, kEqualIds = 2;

// The negative control: run fp16 without the gradient pre-scale (what the kernels did before it).
static bool g_without_prescale = false;

static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

static bool close(double got, double want, double atol, const char* what, int64_t index) {
  if (got == want) return true;  // also the -inf of a row or column without a kept pair
  if (std::fabs(got - want) <= atol + 1e-5 * std::fabs(want)) return true;
  std::printf("  MISMATCH %s[%lld]: got %.8g, want %.8g (atol %.3g)\n", what, static_cast<long long>(index), got,
              want, atol);
  return false;
}

template <typename T>
static const char* name() {
  return std::is_same_v<T, float> ? "fp32" : std::is_same_v<T, c10::Half> ? "fp16" : "bf16";
}

template <typename T>
static bool run_case(const Case& c, std::mt19937& gen, int forward_rows = k::kForwardRowsWide) {
  const int64_t M = c.M, K = c.K, D = c.D;
  unsigned max_splits = 0;  // the most column splits of a launch, printed
  std::normal_distribution<float> normal(0.f, 1.f / std::sqrt(static_cast<float>(D)));
  std::vector<T> rows(M * D), cols(K * D);
  for (auto& v : rows) v = T(normal(gen));
  for (auto& v : cols) v = T(normal(gen));
  if (c.nan_row) rows[1 * D] = T(NAN);
  std::vector<float> g_row(M), g_pos(M), g_col(K);
  std::uniform_real_distribution<float> spread(0.5f, 1.5f);
  std::normal_distribution<float> unit(0.f, 1.f);
  const float g = 0.5f / 65536.f;
  for (auto& v : g_row) v = c.realistic ? g * spread(gen) : unit(gen);
  for (auto& v : g_col) v = c.has_col ? (c.realistic ? g * spread(gen) : unit(gen)) : 0.f;
  for (int64_t i = 0; i < M; ++i) g_pos[i] = c.realistic ? -(g_row[i] + (c.has_col ? g_col[i + c.pos] : 0.f)) : unit(gen);
  const float scale = c.scale;
  const int64_t kernel_pos = clipshard::launch_rules::contrastive_kernel_pos_offset(c.pos, K);  // as the op passes it
  // Ids: about 4 columns per id (duplicates), rows sharing their positive's id; or all equal.
  std::vector<int64_t> row_ids, col_ids;
  if (c.ids != kNoIds) {
    std::uniform_int_distribution<int64_t> pick(0, std::max<int64_t>(K / 4, 1));
    col_ids.resize(K), row_ids.resize(M);
    for (auto& v : col_ids) v = c.ids == kEqualIds ? 5 : pick(gen);
    for (int64_t i = 0; i < M; ++i) row_ids[i] = c.ids == kEqualIds ? 5 : c.pos >= 0 ? col_ids[i + c.pos] : pick(gen);
  }
  const int64_t* row_ids_p = c.ids != kNoIds ? row_ids.data() : nullptr;
  const int64_t* col_ids_p = c.ids != kNoIds ? col_ids.data() : nullptr;

  // dots of a chunk as the fp32-output GEMM gives them.
  auto chunk_dots = [&](int64_t begin, int64_t width) {
    std::vector<float> dots(M * width);
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < width; ++j) {
        double d = 0;
        for (int64_t f = 0; f < D; ++f) d += double(float(rows[i * D + f])) * float(cols[(begin + j) * D + f]);
        dots[i * width + j] = float(d);
      }
    return dots;
  };
  const unsigned gy = static_cast<unsigned>(ceil_div(M, k::kRowsPerCta));        // gradient kernel
  const unsigned gy_forward = static_cast<unsigned>(ceil_div(M, forward_rows));  // forward kernel
  // Column splits by contrastive_lse_chunked.cu's rule (launch_rules.h) on an H200 (132 SMs), or two.
  auto splits = [&](int64_t width, unsigned row_blocks) {
    return c.two_splits ? static_cast<unsigned>(std::min<int64_t>(2, ceil_div(width, k::kThreads)))
                        : clipshard::launch_rules::chunk_column_splits(width, row_blocks, kH200Sms, k::kThreads);
  };

  // Forward, chunk by chunk.
  std::vector<k::Lse> running(M, k::Lse::empty()), row_partial(splits(c.kc, gy_forward) * M), col_partial(gy_forward * c.kc);
  std::vector<float> row_lse(M), pos(M, NAN), col_lse(K);
  for (int64_t begin = 0; begin < K; begin += c.kc) {
    const int64_t width = std::min(c.kc, K - begin);
    const std::vector<float> dots = chunk_dots(begin, width);
    const unsigned gx = splits(width, gy_forward);
    max_splits = std::max(max_splits, gx);
    const k::ForwardChunkParams params{dots.data(), M, width, begin, &scale, kernel_pos, row_partial.data(),
                                       c.has_col ? col_partial.data() : nullptr, pos.data(), row_ids_p, col_ids_p};
    const dim3 grid{gx, gy_forward, 1};
    if (forward_rows == k::kForwardRowsNarrow && row_ids_p)
      emulate_launch(k::chunk_forward_kernel<k::kForwardRowsNarrow, true>, grid, k::kThreads, params);
    else if (forward_rows == k::kForwardRowsNarrow)
      emulate_launch(k::chunk_forward_kernel<k::kForwardRowsNarrow>, grid, k::kThreads, params);
    else if (row_ids_p)
      emulate_launch(k::chunk_forward_kernel<k::kForwardRowsWide, true>, grid, k::kThreads, params);
    else
      emulate_launch(k::chunk_forward_kernel<k::kForwardRowsWide>, grid, k::kThreads, params);
    const bool last = begin + width == K;
    emulate_launch([&](int) { k::merge_row_partials_kernel(running.data(), row_partial.data(), M, int(gx),
                                                           last ? row_lse.data() : nullptr); },
                   unsigned(ceil_div(M, k::kThreads)), k::kThreads, 0);
    if (c.has_col)
      emulate_launch([&](int) { k::merge_col_partials_kernel(col_partial.data(), width, int(gy_forward), begin, col_lse.data()); },
                     unsigned(ceil_div(width, k::kThreads)), k::kThreads, 0);
  }
  // The bias is added to the outputs (and taken out of the LSEs for the backward) by the caller.
  for (auto& v : row_lse) v += c.bias;
  for (auto& v : pos) v += c.bias;
  for (auto& v : col_lse) v += c.bias;
  std::vector<float> row_lse_unbiased(M), col_lse_unbiased(K);
  for (int64_t i = 0; i < M; ++i) row_lse_unbiased[i] = row_lse[i] - c.bias;
  for (int64_t j = 0; j < K; ++j) col_lse_unbiased[j] = col_lse[j] - c.bias;

  // Backward, chunk by chunk: dlogits in T, then the two products with fp32 (here double) sums.
  float prescale[2] = {1.f, 1.f};
  if (std::is_same_v<T, c10::Half> && !g_without_prescale)
    emulate_launch([&](int) { clipshard::fp16_prescale::prescale_kernel(&scale, g_row.data(), M, g_pos.data(),
                                                                        c.has_col ? g_col.data() : nullptr, K, prescale); },
                   1u, clipshard::fp16_prescale::kThreads, 0);
  if (std::is_same_v<T, c10::Half> && !g_without_prescale) {  // the prescale kernel's reductions, exactly
    auto abs_max = [](const std::vector<float>& v) {
      float m = 0.f;
      for (float x : v) m = std::max(m, std::fabs(x));
      return m;
    };
    const float want = clipshard::fp16_prescale::prescale_for_bound(
        std::fabs(scale) * (abs_max(g_row) + abs_max(g_pos) + (c.has_col ? abs_max(g_col) : 0.f)));
    if (prescale[0] != want || prescale[1] != 1.f / want) {
      std::printf("  MISMATCH prescale: got %g (inverse %g), want %g\n", prescale[0], prescale[1], want);
      return false;
    }
  }
  std::vector<double> grad_rows(M * D, 0.0), grad_cols(K * D, 0.0);
  double sum_scale = 0, sum_bias = 0;
  for (int64_t begin = 0; begin < K; begin += c.kc) {
    const int64_t width = std::min(c.kc, K - begin);
    const std::vector<float> dots = chunk_dots(begin, width);
    const unsigned gx = splits(width, gy);
    max_splits = std::max(max_splits, gx);
    std::vector<T> dlogits(M * width);
    std::vector<float> part_scale(gx * gy), part_bias(gx * gy);
    const k::GradChunkParams<T> grad_params{dots.data(), M, width, begin, &scale,
                                            std::is_same_v<T, c10::Half> ? prescale : nullptr, row_lse_unbiased.data(),
                                            g_row.data(), g_pos.data(), c.has_col ? col_lse_unbiased.data() : nullptr,
                                            c.has_col ? g_col.data() : nullptr, kernel_pos, dlogits.data(),
                                            part_scale.data(), part_bias.data(), row_ids_p, col_ids_p};
    if (row_ids_p)
      emulate_launch(k::chunk_grad_kernel<T, true>, dim3{gx, gy, 1}, k::kThreads, grad_params);
    else
      emulate_launch(k::chunk_grad_kernel<T>, dim3{gx, gy, 1}, k::kThreads, grad_params);
    for (float v : part_scale) sum_scale += v;
    for (float v : part_bias) sum_bias += v;
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < width; ++j) {
        const double d = float(dlogits[i * width + j]);
        for (int64_t f = 0; f < D; ++f) {
          grad_rows[i * D + f] += d * float(cols[(begin + j) * D + f]);
          grad_cols[(begin + j) * D + f] += d * float(rows[i * D + f]);
        }
      }
  }
  for (auto& v : grad_rows) v *= prescale[1];
  for (auto& v : grad_cols) v *= prescale[1];

  // Reference in double, from the values the kernels read.
  const std::vector<float> rows_f(rows.begin(), rows.end()), cols_f(cols.begin(), cols.end());
  const LseReference ref = lse_reference(rows_f, cols_f, M, K, D, scale, c.bias, g_row,
                                         c.has_col ? g_col : std::vector<float>{}, g_pos, c.pos, row_ids, col_ids);

  bool ok = true;
  char label[256];
  const char* ids_label[] = {"", " ids=duplicates", " ids=equal"};
  std::snprintf(label, sizeof label, "chunked %s forward-rows=%d M=%lld K=%lld D=%lld kc=%lld pos=%lld scale=%g bias=%g col=%d splits<=%u%s%s%s",
                name<T>(), forward_rows, (long long)M, (long long)K, (long long)D, (long long)c.kc, (long long)c.pos, scale, c.bias,
                c.has_col, max_splits, c.realistic ? " realistic-gradients" : "", c.nan_row ? " NaN" : "", ids_label[c.ids]);
  if (c.nan_row) {  // row 1's LSE, positive and gradient are NaN, and so is every column LSE
    ok &= std::isnan(row_lse[1]) && std::isnan(pos[1]) && std::isnan(grad_rows[1 * D]) && std::isnan(sum_scale);
    for (int64_t j = 0; j < K; ++j) ok &= !c.has_col || std::isnan(col_lse[j]);
    for (int64_t i = 0; i < M; ++i) ok &= (i == 1) || std::isfinite(row_lse[i]);
    std::printf("%s %s\n", ok ? "ok" : "FAILED", label);
    return ok;
  }
  const double atol = 1e-5 * (1 + scale + std::fabs(c.bias));
  for (int64_t i = 0; i < M && ok; ++i) {
    ok &= close(row_lse[i], ref.row_lse[i], atol, "row_lse", i);
    if (c.pos >= 0) ok &= close(pos[i], ref.S[i * K + i + c.pos], atol, "pos_logit", i);
    else ok &= std::isnan(pos[i]);  // never written: no positives
  }
  for (int64_t j = 0; j < K && ok && c.has_col; ++j) ok &= close(col_lse[j], ref.col_lse[j], atol, "col_lse", j);
  // Each gradient entry against the sum of its terms' magnitudes: dlogits are rounded to T once
  // (relative error 2^-11 in fp16, 2^-8 in bf16), so a term lost to underflow fails the check.
  const double grad_tol = std::is_same_v<T, float> ? 1e-4 : std::is_same_v<T, c10::Half> ? 2e-3 : 1.6e-2;
  for (int64_t n = 0; n < M * D && ok; ++n) ok &= close(grad_rows[n], ref.grad_rows[n], grad_tol * ref.bound_rows[n], "grad_rows", n);
  for (int64_t n = 0; n < K * D && ok; ++n) ok &= close(grad_cols[n], ref.grad_cols[n], grad_tol * ref.bound_cols[n], "grad_cols", n);
  ok &= close(sum_scale, ref.grad_scale, 1e-5 * ref.sum_bound, "grad_scale", 0);
  ok &= close(sum_bias, ref.grad_bias, 1e-5 * ref.sum_bound, "grad_bias", 0);
  std::printf("%s %s\n", ok ? "ok" : "FAILED", label);
  return ok;
}

// Without arguments every case runs; with one, only the fp32 32-row-forward run of the case of that index.
int main(int argc, char** argv) {
  std::mt19937 gen(4321);
  // M, K, D, pos_offset, kc, scale, bias, column term, NaN, realistic gradients.
  const Case cases[] = {
      {1, 1, 1, 0, 128, 1.f, 0.f, true, false, false},       // a single column
      {37, 301, 19, 11, 128, 14.3f, 0.75f, true, false, false},  // K not a multiple of kc
      {70, 600, 33, 100, 128, 100.f, 5.f, true, false, false},   // kc < M... and scale 100 with bias
      {200, 300, 24, 50, 256, 14.3f, 0.f, true, false, false},   // kc > K: one chunk, two column splits
      {45, 520, 16, 7, 256, 14.3f, -2.f, false, false, false},   // no column term
      {40, 300, 24, 10, 128, 14.3f, 0.f, true, true, false},     // NaN
      {20, 2900, 16, 5, 2048, 14.3f, 1.f, true, false, false},   // few rows: 8 column splits, then 4
      // Sample ids: duplicates (scale 100 too), all equal (columns without an own row: LSE -inf), no
      // positives with duplicates, and no positives with all equal (nothing is kept).
      {70, 600, 33, 100, 128, 14.3f, 0.5f, true, false, false, false, kDuplicateIds},
      {37, 1301, 19, 11, 512, 100.f, -1.f, true, false, false, false, kDuplicateIds},
      {45, 1520, 16, 7, 1024, 14.3f, 0.f, true, false, false, false, kEqualIds},
      {40, 900, 24, -1, 768, 14.3f, 0.75f, true, false, false, false, kDuplicateIds},
      {33, 200, 8, -1, 128, 14.3f, 0.f, true, false, false, false, kEqualIds},
      // Realistic upstream gradients, for the fp16 underflow they cause; with an H200's 16 column
      // splits this case alone would take most of the emulation's time (each CTA's shuffles are
      // barriers of its 256 emulated threads), so it keeps 2.
      {64, 16384, 64, 0, 4096, 14.3f, 0.f, true, false, true, true},
  };
  bool all = true;
  if (argc > 1) {
    all = run_case<float>(cases[std::atoi(argv[1])], gen);
    std::printf(all ? "ALL OK\n" : "SOME FAILED\n");
    return all ? 0 : 1;
  }
  for (const Case& c : cases) all &= run_case<float>(c, gen);
  for (const Case& c : cases) all &= run_case<c10::BFloat16>(c, gen);
  for (const Case& c : cases) all &= run_case<c10::Half>(c, gen);
  // The 16-row forward variant: fp32 only (the forward reads fp32 dots whatever the features' dtype),
  // every case but the last, whose forward (realistic gradients matter only backward) is the costliest.
  for (int n = 0; n + 1 < static_cast<int>(std::size(cases)); ++n)
    all &= run_case<float>(cases[n], gen, k::kForwardRowsNarrow);
  // Control: with realistic gradients, fp16 dlogits without the pre-scale underflow and must fail.
  g_without_prescale = true;
  const bool control_failed = !run_case<c10::Half>(cases[std::size(cases) - 1], gen);
  std::printf("%s control: fp16 without the pre-scale %s\n", control_failed ? "ok" : "FAILED",
              control_failed ? "loses the negative-pair gradients, as expected" : "passed: the test cannot see underflow");
  all &= control_failed;
  std::printf(all ? "ALL OK\n" : "SOME FAILED\n");
  return all ? 0 : 1;
}
