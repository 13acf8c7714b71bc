// Runs the distillation op's CUDA kernels (csrc/cuda/distill_lse_kernels.cuh, with the merge
// kernels of contrastive_lse_chunked_kernels.cuh and fp16_prescale.cuh) on the host through
// emulate_cuda.h, driven chunk by chunk as distill_lse.cu drives them, and compares the forward's
// statistics and the backward's dS and dT^k (the GEMMs' inputs; the GEMMs are ATen's) with a
// double-precision reference of the op's formulas. The similarities are given as fp32 matrices,
// as the fp32-output GEMMs write them.
// Build: g++ -std=c++20 -O1 -pthread -I<repo>/csrc/cuda -I<repo>/csrc/include -I<torch>/include
// Prints one line per case and exits non-zero on any mismatch.
// tests/cuda_emulation/test_distill_cuda_emulation.py builds and runs it, and once more against a broken copy of
// the kernels, which must fail.
#include "emulate_cuda.h"
// The kernels, compiled as host code:
#include "distill_lse_kernels.cuh"
#include "fp16_prescale.cuh"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

namespace k = clipshard::distill_cuda;
using Stat = k::Stat;
using Lse = k::Lse;

struct Case {
  int64_t M, K, T, pos, kc;
  float scale;
  std::vector<float> teacher_scale;
  bool realistic;  // upstream gradients of a real loss (0.5 / 65536) instead of N(0, 1)
};

// The negative control: fp16 without the gradient pre-scale.
static bool g_without_prescale = false;

static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

template <typename T>
static const char* name() {
  return std::is_same_v<T, float> ? "fp32" : std::is_same_v<T, c10::Half> ? "fp16" : "bf16";
}

static bool close(double got, double want, double atol, const char* what, int64_t index) {
  if (std::fabs(got - want) <= atol + 2e-6 * std::fabs(want)) return true;
  std::printf("  MISMATCH %s[%lld]: got %.8g, want %.8g (atol %.3g)\n", what, static_cast<long long>(index), got,
              want, atol);
  return false;
}

static double lse_of(const std::vector<double>& x) {
  double m = -INFINITY, s = 0;
  for (double v : x) m = std::max(m, v);
  for (double v : x) s += std::exp(v - m);
  return m + std::log(s);
}

template <typename T>
static bool run_case(const Case& c, std::mt19937& gen) {
  const int64_t M = c.M, K = c.K, T_ = c.T, D = 8;
  // Dots of unit-norm random features, rounded to fp32 as the GEMM writes them.
  std::normal_distribution<double> normal(0.0, 1.0);
  auto unit_features = [&](int64_t n) {
    std::vector<double> f(n * D);
    for (int64_t i = 0; i < n; ++i) {
      double norm = 0;
      for (int64_t d = 0; d < D; ++d) norm += (f[i * D + d] = normal(gen)) * f[i * D + d];
      for (int64_t d = 0; d < D; ++d) f[i * D + d] /= std::sqrt(norm);
    }
    return f;
  };
  auto dots_of = [&](const std::vector<double>& a, const std::vector<double>& b) {
    std::vector<float> out(M * K);
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < K; ++j) {
        double d = 0;
        for (int64_t f = 0; f < D; ++f) d += a[i * D + f] * b[j * D + f];
        out[i * K + j] = float(d);
      }
    return out;
  };
  const std::vector<float> sdot = dots_of(unit_features(M), unit_features(K));
  std::vector<std::vector<float>> tdot;
  for (int64_t t = 0; t < T_; ++t) tdot.push_back(dots_of(unit_features(M), unit_features(K)));
  const float scale = c.scale;
  const std::vector<float>& ts = c.teacher_scale;

  // ------------------------------------------------------------------ forward, chunk by chunk
  const unsigned gy = unsigned(ceil_div(M, k::kForwardRows));
  auto splits = [&](int64_t width) { return unsigned(std::min<int64_t>(2, ceil_div(width, k::kThreads))); };
  std::vector<Lse> running(M, Lse::empty()), row_partial(2 * M), col_partial(gy * c.kc);
  std::vector<Stat> t_running(T_ * M, Stat::empty()), t_row_partial(2 * M), t_col_partial(gy * c.kc);
  std::vector<float> row_lse(M), pos(M, NAN), col_lse(K), t_row_lse(T_ * M), row_cross(T_ * M);
  std::vector<float> t_col_lse(T_ * K), col_cross(T_ * K);
  auto chunk_of = [&](const std::vector<float>& full, int64_t begin, int64_t width) {
    std::vector<float> out(M * width);
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < width; ++j) out[i * width + j] = full[i * K + begin + j];
    return out;
  };
  for (int64_t begin = 0; begin < K; begin += c.kc) {
    const int64_t width = std::min(c.kc, K - begin);
    const bool last = begin + width == K;
    const unsigned gx = splits(width);
    const std::vector<float> s = chunk_of(sdot, begin, width);
    for (int64_t t = 0; t < T_; ++t) {
      const std::vector<float> d = chunk_of(tdot[t], begin, width);
      const bool student = t == 0;
      const k::ForwardParams p{s.data(), d.data(), M, width, begin, &scale, &ts[t], c.pos,
                               student ? row_partial.data() : nullptr, t_row_partial.data(),
                               student ? col_partial.data() : nullptr, t_col_partial.data(), pos.data()};
      emulate_launch(k::distill_forward_kernel, dim3{gx, gy, 1}, k::kThreads, p);
      const unsigned row_grid = unsigned(ceil_div(M, k::kThreads)), col_grid = unsigned(ceil_div(width, k::kThreads));
      if (student) {
        emulate_launch([&](int) { clipshard::chunked_cuda::merge_row_partials_kernel(
                                      running.data(), row_partial.data(), M, int(gx), last ? row_lse.data() : nullptr); },
                       row_grid, k::kThreads, 0);
        emulate_launch([&](int) { clipshard::chunked_cuda::merge_col_partials_kernel(col_partial.data(), width, int(gy),
                                                                                      begin, col_lse.data()); },
                       col_grid, k::kThreads, 0);
      }
      emulate_launch([&](int) { k::merge_teacher_row_partials_kernel(
                                    t_running.data() + t * M, t_row_partial.data(), M, int(gx),
                                    last ? t_row_lse.data() + t * M : nullptr, last ? row_cross.data() + t * M : nullptr); },
                     row_grid, k::kThreads, 0);
      emulate_launch([&](int) { k::merge_teacher_col_partials_kernel(t_col_partial.data(), width, int(gy), begin,
                                                                      t_col_lse.data() + t * K, col_cross.data() + t * K); },
                     col_grid, k::kThreads, 0);
    }
  }

  // ------------------------------------------------------------------ double reference
  std::vector<double> S(M * K), R_lse(M), C_lse(K), TR_lse(T_ * M), TC_lse(T_ * K), RC(T_ * M, 0), CC(T_ * K, 0);
  std::vector<std::vector<double>> Tl(T_, std::vector<double>(M * K));
  for (int64_t n = 0; n < M * K; ++n) S[n] = double(scale) * sdot[n];
  for (int64_t t = 0; t < T_; ++t)
    for (int64_t n = 0; n < M * K; ++n) Tl[t][n] = double(ts[t]) * tdot[t][n];
  auto row = [&](const std::vector<double>& x, int64_t i) { return std::vector<double>(x.begin() + i * K, x.begin() + (i + 1) * K); };
  auto col = [&](const std::vector<double>& x, int64_t j) {
    std::vector<double> v(M);
    for (int64_t i = 0; i < M; ++i) v[i] = x[i * K + j];
    return v;
  };
  for (int64_t i = 0; i < M; ++i) R_lse[i] = lse_of(row(S, i));
  for (int64_t j = 0; j < K; ++j) C_lse[j] = lse_of(col(S, j));
  for (int64_t t = 0; t < T_; ++t) {
    for (int64_t i = 0; i < M; ++i) TR_lse[t * M + i] = lse_of(row(Tl[t], i));
    for (int64_t j = 0; j < K; ++j) TC_lse[t * K + j] = lse_of(col(Tl[t], j));
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < K; ++j) {
        RC[t * M + i] += std::exp(Tl[t][i * K + j] - TR_lse[t * M + i]) * S[i * K + j];
        CC[t * K + j] += std::exp(Tl[t][i * K + j] - TC_lse[t * K + j]) * S[i * K + j];
      }
  }

  bool ok = true;
  char label[200];
  std::snprintf(label, sizeof label, "distill %s M=%lld K=%lld T=%lld kc=%lld pos=%lld scale=%g%s", name<T>(),
                (long long)M, (long long)K, (long long)T_, (long long)c.kc, (long long)c.pos, scale,
                c.realistic ? " realistic-gradients" : "");
  const double atol = 2e-6 * (1 + std::max<double>(scale, *std::max_element(ts.begin(), ts.end())));
  for (int64_t i = 0; i < M && ok; ++i) {
    ok &= close(row_lse[i], R_lse[i], atol, "row_lse", i);
    ok &= close(pos[i], S[i * K + i + c.pos], atol, "pos_logit", i);
    for (int64_t t = 0; t < T_; ++t) {
      ok &= close(t_row_lse[t * M + i], TR_lse[t * M + i], atol, "teacher_row_lse", t * M + i);
      ok &= close(row_cross[t * M + i], RC[t * M + i], atol, "row_cross", t * M + i);
    }
  }
  for (int64_t j = 0; j < K && ok; ++j) {
    ok &= close(col_lse[j], C_lse[j], atol, "col_lse", j);
    for (int64_t t = 0; t < T_; ++t) {
      ok &= close(t_col_lse[t * K + j], TC_lse[t * K + j], atol, "teacher_col_lse", t * K + j);
      ok &= close(col_cross[t * K + j], CC[t * K + j], atol, "col_cross", t * K + j);
    }
  }

  // ------------------------------------------------------------------ backward, chunk by chunk
  std::uniform_real_distribution<float> spread(0.5f, 1.5f);
  std::normal_distribution<float> unit(0.f, 1.f);
  auto draw = [&](int64_t n) {
    std::vector<float> v(n);
    for (auto& x : v) x = c.realistic ? 0.5f / 65536.f * spread(gen) : unit(gen);
    return v;
  };
  const std::vector<float> g_rl = draw(M), g_pos = draw(M), g_trl = draw(T_ * M), g_rc = draw(T_ * M);
  const std::vector<float> g_cl = draw(K), g_tcl = draw(T_ * K), g_cc = draw(T_ * K);
  // The prescales as distill_lse.cu computes them (fp16 only): bounds of |dS| and of each |dT^k|.
  std::vector<float> expected(2 * (1 + T_), 1.f);
  if (std::is_same_v<T, c10::Half>) {
    const float one = 1.f, width = 2.f * std::fabs(scale);  // unit-norm features: |s - cross| <= 2 |scale|
    std::vector<float> r(M), cc(K), zeros(M, 0.f);
    for (int64_t i = 0; i < M; ++i) {
      r[i] = std::fabs(g_rl[i]);
      for (int64_t t = 0; t < T_; ++t) r[i] += std::fabs(g_rc[t * M + i]);
    }
    for (int64_t j = 0; j < K; ++j) {
      cc[j] = std::fabs(g_cl[j]);
      for (int64_t t = 0; t < T_; ++t) cc[j] += std::fabs(g_cc[t * K + j]);
    }
    auto prescale_of = [&](const std::vector<float>& rv, const std::vector<float>& gp, const std::vector<float>& cv,
                           float* out) {
      emulate_launch([&](int) { clipshard::fp16_prescale::prescale_kernel(&one, rv.data(), M, gp.data(), cv.data(),
                                                                          K, out); },
                     1u, clipshard::fp16_prescale::kThreads, 0);
    };
    prescale_of(r, g_pos, cc, expected.data());
    for (int64_t t = 0; t < T_; ++t) {
      std::vector<float> rt(M), ct(K);
      for (int64_t i = 0; i < M; ++i) rt[i] = std::fabs(g_trl[t * M + i]) + std::fabs(g_rc[t * M + i]) * width;
      for (int64_t j = 0; j < K; ++j) ct[j] = std::fabs(g_tcl[t * K + j]) + std::fabs(g_cc[t * K + j]) * width;
      prescale_of(rt, zeros, ct, expected.data() + 2 * (1 + t));
    }
  }
  const std::vector<float> prescale = g_without_prescale ? std::vector<float>(2 * (1 + T_), 1.f) : expected;
  // The kernels read the forward's fp32 statistics, as the op's backward does.
  std::vector<double> dS(M * K), dT(T_ * M * K);
  const unsigned gy_grad = unsigned(ceil_div(M, k::kGradRows));
  for (int64_t begin = 0; begin < K; begin += c.kc) {
    const int64_t width = std::min(c.kc, K - begin);
    const std::vector<float> s = chunk_of(sdot, begin, width);
    std::vector<float> teachers(T_ * M * c.kc);
    for (int64_t t = 0; t < T_; ++t) {
      const std::vector<float> d = chunk_of(tdot[t], begin, width);
      std::copy(d.begin(), d.end(), teachers.begin() + t * M * c.kc);
    }
    std::vector<T> ds(M * width), dt(T_ * M * c.kc);
    const k::GradParams<T, T> p{s.data(), teachers.data(), M, K, width, begin, T_, M * c.kc, &scale, ts.data(),
                                prescale.data(), c.pos, g_rl.data(), row_lse.data(), g_pos.data(), g_cl.data(),
                                col_lse.data(), g_trl.data(), g_rc.data(), t_row_lse.data(), row_cross.data(),
                                g_tcl.data(), g_cc.data(), t_col_lse.data(), col_cross.data(), ds.data(), dt.data()};
    emulate_launch(k::distill_grad_kernel<T, T>, dim3{splits(width), gy_grad, 1}, k::kThreads, p);
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < width; ++j) {
        dS[i * K + begin + j] = double(float(ds[i * width + j])) / prescale[0];
        for (int64_t t = 0; t < T_; ++t)
          dT[(t * M + i) * K + begin + j] = double(float(dt[t * M * c.kc + i * width + j])) / prescale[2 * (1 + t)];
      }
  }
  // Each dlogit against its formula, within the rounding of its dtype (plus the fp32 rounding of
  // s - cross, hence |s| + |cross| in the bounds, and
  // logits as large as the scales, which moves every softmax by a few ulps of the largest logit)
  // times the sum of its terms' magnitudes, plus a floor below which the dtype cannot go: fp32/bf16
  // denormals, and for fp16 the subnormal spacing 2^-24 over the pre-scale the harness expects
  // (without the pre-scale a realistic gradient's terms lie far above it and are lost).
  const double max_scale = std::max<double>(scale, *std::max_element(ts.begin(), ts.end()));
  const double tol = (std::is_same_v<T, float> ? 2e-5 : std::is_same_v<T, c10::Half> ? 2e-3 : 1.6e-2) +
                     4 * std::ldexp(max_scale, -24);
  const bool half = std::is_same_v<T, c10::Half>;
  std::vector<double> ds_want(M * K), ds_bound(M * K), dt_want(T_ * M * K), dt_bound(T_ * M * K);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < K; ++j) {
      const int64_t n = i * K + j;
      const double s = S[n], er = std::exp(s - R_lse[i]), ec = std::exp(s - C_lse[j]);
      double want = g_rl[i] * er + g_cl[j] * ec + (j == i + c.pos ? g_pos[i] : 0.0);
      double bound = std::fabs(g_rl[i] * er) + std::fabs(g_cl[j] * ec) + (j == i + c.pos ? std::fabs(g_pos[i]) : 0.0);
      for (int64_t t = 0; t < T_; ++t) {
        const double P = std::exp(Tl[t][n] - TR_lse[t * M + i]), Q = std::exp(Tl[t][n] - TC_lse[t * K + j]);
        const double gr = g_rc[t * M + i], gc = g_cc[t * K + j];
        want += gr * P + gc * Q;
        bound += std::fabs(gr * P) + std::fabs(gc * Q);
        const double a = g_trl[t * M + i] + gr * (s - RC[t * M + i]), b = g_tcl[t * K + j] + gc * (s - CC[t * K + j]);
        dt_want[t * M * K + n] = P * a + Q * b;
        dt_bound[t * M * K + n] = P * (std::fabs(g_trl[t * M + i]) + std::fabs(gr) * (std::fabs(s) + std::fabs(RC[t * M + i]))) +
                                  Q * (std::fabs(g_tcl[t * K + j]) + std::fabs(gc) * (std::fabs(s) + std::fabs(CC[t * K + j])));
      }
      ds_want[n] = want;
      ds_bound[n] = bound;
    }
  auto floor_of = [&](int64_t which) { return half ? std::ldexp(1.0, -24) / expected[2 * which] : 1e-37; };
  const double ds_floor = floor_of(0);
  for (int64_t n = 0; n < M * K && ok; ++n) ok &= close(dS[n], ds_want[n], tol * ds_bound[n] + ds_floor, "dS", n);
  for (int64_t t = 0; t < T_ && ok; ++t) {
    const double dt_floor = floor_of(1 + t);
    for (int64_t n = t * M * K; n < (t + 1) * M * K && ok; ++n)
      ok &= close(dT[n], dt_want[n], tol * dt_bound[n] + dt_floor, "dT", n);
  }
  std::printf("%s %s\n", ok ? "ok" : "FAILED", label);
  return ok;
}

// With --quick: the fp32 two-teacher case alone (for the test that breaks a kernel on purpose).
int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::string(argv[1]) == "--quick";
  std::mt19937 gen(2468);
  const Case cases[] = {
      {1, 1, 1, 0, 128, 1.f, {1.f}, false},                   // a single pair
      {37, 301, 2, 11, 128, 14.3f, {10.f, 30.f}, false},      // K not a multiple of kc, two teachers, 3 row blocks
      {20, 300, 1, 100, 256, 100.f, {100.f}, false},          // scales 100, two column splits
      {17, 400, 2, 5, 128, 14.3f, {20.f, 5.f}, true},         // realistic upstream gradients
  };
  bool all = true;
  if (quick) {
    all = run_case<float>(cases[1], gen);
    std::printf(all ? "ALL OK\n" : "SOME FAILED\n");
    return all ? 0 : 1;
  }
  // Every case in fp32; the 16-bit dlogits (the forward reads fp32 whatever the dtype) on the cases
  // where their rounding matters: two teachers, scale 100 (fp16), realistic gradients.
  for (const Case& c : cases) all &= run_case<float>(c, gen);
  for (int n : {1, 3}) all &= run_case<c10::BFloat16>(cases[n], gen);
  for (int n : {1, 2, 3}) all &= run_case<c10::Half>(cases[n], gen);
  // Control: with realistic gradients, fp16 dlogits without the pre-scale underflow and must fail.
  g_without_prescale = true;
  const bool control_failed = !run_case<c10::Half>(cases[3], gen);
  std::printf("%s control: fp16 without the pre-scale %s\n", control_failed ? "ok" : "FAILED",
              control_failed ? "loses the realistic gradients, as expected" : "passed: the test cannot see underflow");
  all &= control_failed;
  std::printf(all ? "ALL OK\n" : "SOME FAILED\n");
  return all ? 0 : 1;
}
