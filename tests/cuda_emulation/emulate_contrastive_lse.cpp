// Runs the CUDA kernels of csrc/cuda/contrastive_lse_{kernels,mma}.cuh on the host through
// emulate_cuda.h / emulate_mma.h and compares them with a double-precision reference of the same
// maths: the FMA kernels in fp32, the tensor-core kernels in bf16 and fp16.
// Build: g++ -std=c++20 -O1 -pthread -I<repo>/csrc/cuda -I<torch>/include emulate_contrastive_lse.cpp
// Prints one line per case and exits non-zero on any mismatch.
#define CLIPSHARD_LSE_HOST_EMULATION
#include "emulate_cuda.h"
#include "emulate_mma.h"
// The kernels, compiled as host code, and the op's pos_offset rule (-1: no positives):
#include "clipshard/launch_rules.h"
#include "contrastive_lse_mma.cuh"
#include "fp16_prescale.cuh"
#include "lse_reference.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <type_traits>

namespace k = clipshard::lse_cuda;

struct Case {
  int64_t M, K, D, pos;
  float scale;
  bool has_bias, has_col;
  bool nan_row;  // put a NaN into row 1
  bool realistic = false;  // upstream gradients of a real loss: 0.5 / 65536 per row and column
};

// The negative control: run fp16 without the gradient pre-scale (what the kernels did before it).
static bool g_without_prescale = false;

static unsigned blocks(int64_t n) { return static_cast<unsigned>((n + k::kTile - 1) / k::kTile); }

static bool close(double got, double want, double atol, const char* what, int64_t index) {
  if (std::fabs(got - want) <= atol + 1e-5 * std::fabs(want)) return true;
  std::printf("  MISMATCH %s[%lld]: got %.8g, want %.8g (atol %.3g)\n", what,
              static_cast<long long>(index), got, want, atol);
  return false;
}

// T = float runs the FMA kernels; T = c10::BFloat16 / c10::Half the tensor-core kernels.
template <typename T>
static bool run_case(const Case& c, std::mt19937& gen) {
  constexpr bool kMma = !std::is_same_v<T, float>;
  const char* path = kMma ? (std::is_same_v<T, c10::Half> ? "mma fp16" : "mma bf16") : "fma fp32";
  const int64_t M = c.M, K = c.K, D = c.D;
  std::normal_distribution<float> normal(0.f, 1.f / std::sqrt(static_cast<float>(D)));
  std::vector<T> rows(M * D), cols(K * D);
  std::vector<float> g_row(M), g_pos(M), g_col(K);
  for (auto& v : rows) v = T(normal(gen));
  for (auto& v : cols) v = T(normal(gen));
  std::normal_distribution<float> unit(0.f, 1.f);
  for (auto& v : g_row) v = unit(gen);
  for (auto& v : g_pos) v = unit(gen);
  for (auto& v : g_col) v = unit(gen);
  if (c.realistic) {
    std::uniform_real_distribution<float> spread(0.5f, 1.5f);
    const float g = 0.5f / 65536.f;
    for (auto& v : g_row) v = g * spread(gen);
    for (auto& v : g_col) v = g * spread(gen);
    for (int64_t i = 0; i < M && c.pos >= 0; ++i) g_pos[i] = -(g_row[i] + g_col[i + c.pos]);
  }
  if (c.nan_row) rows[1 * D + 0] = T(NAN);
  const float scale = c.scale, bias = 0.75f;
  const float* bias_p = c.has_bias ? &bias : nullptr;

  // Kernels.
  const auto forward = kMma ? k::lse_forward_mma_kernel<T> : k::lse_forward_kernel<T>;
  const auto backward = kMma ? k::lse_backward_mma_kernel<T> : k::lse_backward_kernel<T>;
  const unsigned threads = kMma ? k::kMmaThreads : k::kThreads;
  // pos_offset as contrastive_lse.cu passes it: K for -1 (no positives), negated for the column pass.
  const int64_t kernel_pos = clipshard::launch_rules::contrastive_kernel_pos_offset(c.pos, K);
  std::vector<float> row_lse(M), pos(M, NAN), col_lse(K);
  emulate_launch(forward, blocks(M), threads,
                 k::ForwardParams<T>{rows.data(), cols.data(), M, K, D, &scale, bias_p,
                                     row_lse.data(), pos.data(), kernel_pos});
  emulate_launch(forward, blocks(K), threads,
                 k::ForwardParams<T>{cols.data(), rows.data(), K, M, D, &scale, bias_p,
                                     col_lse.data(), nullptr, 0});
  std::vector<float> grad_rows(M * D, 0.f), grad_cols(K * D, 0.f), partials(2 * blocks(M)), sums(2);
  const float* g_col_p = c.has_col ? g_col.data() : nullptr;
  float prescale[2] = {1.f, 1.f};  // fp16 tensor-core operands are pre-scaled (fp16_prescale.cuh)
  const bool prescaled = std::is_same_v<T, c10::Half> && !g_without_prescale;
  if (prescaled)
    emulate_launch([&](int) { clipshard::fp16_prescale::prescale_kernel(&scale, g_row.data(), M, g_pos.data(), g_col_p,
                                                                        K, prescale); },
                   1u, clipshard::fp16_prescale::kThreads, 0);
  const float* prescale_p = prescaled ? prescale : nullptr;
  const float* col_lse_p = c.has_col ? col_lse.data() : nullptr;
  emulate_launch(backward, blocks(M), threads,
                 k::BackwardParams<T>{rows.data(), cols.data(), M, K, D, &scale, bias_p,
                                      row_lse.data(), g_row.data(), col_lse_p, g_col_p,
                                      g_pos.data(), true, kernel_pos, grad_rows.data(),
                                      partials.data(), partials.data() + blocks(M), prescale_p});
  emulate_launch(backward, blocks(K), threads,
                 k::BackwardParams<T>{cols.data(), rows.data(), K, M, D, &scale, bias_p,
                                      col_lse_p, g_col_p, row_lse.data(), g_row.data(),
                                      g_pos.data(), false, -kernel_pos, grad_cols.data(), nullptr,
                                      nullptr, prescale_p});
  for (auto& v : grad_rows) v *= prescale[1];
  for (auto& v : grad_cols) v *= prescale[1];
  auto sum_kernel = [&](int) {
    k::sum_partials_kernel(partials.data(), partials.data() + blocks(M), blocks(M), sums.data());
  };
  emulate_launch(sum_kernel, 1, k::kThreads, 0);

  // Reference in double, from the values the kernels read.
  const std::vector<float> rows_f(rows.begin(), rows.end()), cols_f(cols.begin(), cols.end());
  const LseReference ref = lse_reference(rows_f, cols_f, M, K, D, scale, c.has_bias ? bias : 0.f, g_row,
                                         c.has_col ? g_col : std::vector<float>{}, g_pos, c.pos);

  bool ok = true;
  if (c.nan_row) {  // NaN in row 1: its row LSE, its positive logit and every column LSE are NaN
    ok &= std::isnan(row_lse[1]) && std::isnan(pos[1]) && std::isnan(grad_rows[1 * D]);
    for (int64_t j = 0; j < K; ++j) ok &= std::isnan(col_lse[j]);
    for (int64_t i = 0; i < M; ++i) ok &= (i == 1) || std::isfinite(row_lse[i]);
    ok &= std::isnan(sums[0]);
    std::printf("%s %s NaN case M=%lld K=%lld D=%lld\n", ok ? "ok" : "FAILED", path, (long long)M,
                (long long)K, (long long)D);
    return ok;
  }
  const double atol = 1e-5 * (1 + scale);
  for (int64_t i = 0; i < M && ok; ++i) {
    ok &= close(row_lse[i], ref.row_lse[i], atol, "row_lse", i);
    // Without positives no logit is one: the kernel writes none (the op then fills NaN).
    ok &= c.pos >= 0 ? close(pos[i], ref.S[i * K + i + c.pos], atol, "pos_logit", i)
                     : std::isnan(pos[i]) || close(pos[i], NAN, 0, "pos_logit (none)", i);
  }
  for (int64_t j = 0; j < K && ok; ++j) ok &= close(col_lse[j], ref.col_lse[j], atol, "col_lse", j);
  // The tensor-core backward rounds (pre-scaled) scale * dS to T before the dS @ other product:
  // each gradient entry is checked against the sum of its terms' magnitudes, so a term lost to
  // underflow fails the check.
  const double grad_tol = !kMma ? 1e-4 : std::is_same_v<T, c10::Half> ? 2e-3 : 1.6e-2;
  for (int64_t n = 0; n < M * D && ok; ++n)
    ok &= close(grad_rows[n], ref.grad_rows[n], grad_tol * ref.bound_rows[n], "grad_rows", n);
  for (int64_t n = 0; n < K * D && ok; ++n)
    ok &= close(grad_cols[n], ref.grad_cols[n], grad_tol * ref.bound_cols[n], "grad_cols", n);
  ok &= close(sums[0], ref.grad_scale, 1e-5 * ref.sum_bound, "grad_scale", 0);
  ok &= close(sums[1], ref.grad_bias, 1e-5 * ref.sum_bound, "grad_bias", 0);
  std::printf("%s %s M=%lld K=%lld D=%lld pos=%lld scale=%g bias=%d col=%d%s\n", ok ? "ok" : "FAILED",
              path, (long long)M, (long long)K, (long long)D, (long long)c.pos, scale, c.has_bias,
              c.has_col, c.realistic ? " realistic-gradients" : "");
  return ok;
}

int main() {
  std::mt19937 gen(1234);
  // M, K, D, pos_offset, scale, bias, column term, NaN. The tensor-core kernels need D % 8 == 0.
  const Case fma_cases[] = {
      {1, 1, 1, 0, 1.f, false, true, false},     {3, 5, 17, 2, 14.3f, true, true, false},
      {65, 130, 33, 1, 1.f, true, true, false},  {70, 200, 40, 100, 100.f, false, true, false},
      {129, 129, 64, 0, 14.3f, true, false, false}, {20, 70, 9, 50, 100.f, true, true, false},
      {40, 90, 24, 10, 14.3f, false, true, true},
      // pos_offset -1: no own positives, K > M (the extra columns hard negatives), with and without bias
      {40, 90, 24, -1, 14.3f, true, true, false},  {65, 130, 33, -1, 1.f, false, true, false},
  };
  const Case mma_cases[] = {
      {1, 1, 8, 0, 1.f, false, true, false},     {3, 5, 16, 2, 14.3f, true, true, false},
      {65, 130, 40, 1, 1.f, true, true, false},  {70, 200, 72, 100, 100.f, false, true, false},
      {129, 129, 64, 0, 14.3f, true, false, false}, {40, 90, 24, 10, 14.3f, false, true, true},
      {64, 4096, 64, 0, 14.3f, false, true, false, true},  // realistic upstream gradients: fp16 underflows without the pre-scale
      {70, 200, 72, -1, 100.f, true, true, false},  // pos_offset -1: no own positives, 130 hard-negative columns
  };
  bool all = true;
  for (const Case& c : fma_cases) all &= run_case<float>(c, gen);
  for (const Case& c : mma_cases) all &= run_case<c10::BFloat16>(c, gen);
  for (const Case& c : mma_cases)  // fp16 differs from bf16 in pack_pair and the pre-scale
    if (c.M == 3 || c.M == 70 || c.nan_row || c.realistic) all &= run_case<c10::Half>(c, gen);
  // Control: with realistic gradients, fp16 dS without the pre-scale underflows and must fail.
  g_without_prescale = true;
  const bool control_failed = !run_case<c10::Half>(mma_cases[6], gen);  // the realistic case
  std::printf("%s control: fp16 without the pre-scale %s\n", control_failed ? "ok" : "FAILED",
              control_failed ? "loses the negative-pair gradients, as expected" : "passed: the test cannot see underflow");
  all &= control_failed;
  std::printf(all ? "ALL OK\n" : "SOME FAILED\n");
  return all ? 0 : 1;
}
