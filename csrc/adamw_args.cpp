// Validation of clipshard::adamw_step_'s arguments (shared by the CPU and CUDA kernels).
#include "adamw_args.h"

#include <algorithm>
#include <cmath>

namespace clipshard {
namespace {

Storage storage_of(at::ScalarType dtype, const char* what) {
  switch (dtype) {
    case at::kFloat: return Storage::kFloat;
    case at::kHalf: return Storage::kHalf;
    case at::kBFloat16: return Storage::kBFloat16;
    default:
      TORCH_CHECK(false, "adamw_step_: ", what, " must be float32, float16 or bfloat16, got ", dtype);
  }
}

void check_like(const at::Tensor& t, const at::Tensor& param, at::ScalarType dtype, const char* name,
                size_t i) {
  TORCH_CHECK(t.device() == param.device(), "adamw_step_: ", name, "[", i, "] must be on ", param.device(),
              " like params[", i, "], got ", t.device());
  TORCH_CHECK(t.scalar_type() == dtype, "adamw_step_: ", name, "[", i, "] must have dtype ", dtype,
              ", got ", t.scalar_type());
  TORCH_CHECK(t.sizes() == param.sizes(), "adamw_step_: ", name, "[", i, "] must have the shape of params[",
              i, "] ", param.sizes(), ", got ", t.sizes());
  TORCH_CHECK(t.is_contiguous(), "adamw_step_: ", name, "[", i, "] must be contiguous");
  TORCH_CHECK(t.layout() == at::kStrided, "adamw_step_: ", name, "[", i, "] must be a dense tensor, got ",
              t.layout());
}

}  // namespace

AdamWArgs make_adamw_args(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                          at::TensorList exp_avg_sqs, at::IntArrayRef steps, double lr, double beta1,
                          double beta2, double eps, double weight_decay, bool maximize,
                          bool stochastic_rounding, int64_t seed, int64_t offset,
                          at::OptionalIntArrayRef tensor_numbers, at::OptionalIntArrayRef index_bases,
                          at::DeviceType device_type) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n && steps.size() == n,
              "adamw_step_: params, grads, exp_avgs, exp_avg_sqs and steps must have the same length, got ",
              n, ", ", grads.size(), ", ", exp_avgs.size(), ", ", exp_avg_sqs.size(), " and ", steps.size());
  TORCH_CHECK(static_cast<int64_t>(n) * 3 <= kMaxStreams, "adamw_step_: at most ", kMaxStreams / 3,
              " tensors per call, got ", n);
  TORCH_CHECK(!tensor_numbers.has_value() || tensor_numbers->size() == n, "adamw_step_: tensor_numbers must ",
              "have one entry per tensor (", n, "), got ", tensor_numbers->size());
  TORCH_CHECK(!index_bases.has_value() || index_bases->size() == n, "adamw_step_: index_bases must have one ",
              "entry per tensor (", n, "), got ", index_bases->size());
  if (tensor_numbers.has_value()) {
    std::vector<int64_t> sorted(tensor_numbers->begin(), tensor_numbers->end());
    std::sort(sorted.begin(), sorted.end());
    TORCH_CHECK(std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end(),
                "adamw_step_: tensor_numbers must be distinct (each tensor has its own random streams)");
  }
  TORCH_CHECK(lr >= 0.0 && std::isfinite(lr), "adamw_step_: lr must be finite and >= 0, got ", lr);
  TORCH_CHECK(beta1 >= 0.0 && beta1 < 1.0, "adamw_step_: beta1 must be in [0, 1), got ", beta1);
  TORCH_CHECK(beta2 >= 0.0 && beta2 < 1.0, "adamw_step_: beta2 must be in [0, 1), got ", beta2);
  TORCH_CHECK(eps >= 0.0, "adamw_step_: eps must be >= 0, got ", eps);
  TORCH_CHECK(weight_decay >= 0.0, "adamw_step_: weight_decay must be >= 0, got ", weight_decay);

  AdamWArgs a;
  a.hyper = {static_cast<float>(1.0 - lr * weight_decay), static_cast<float>(1.0 - beta1),
             static_cast<float>(beta2), static_cast<float>(1.0 - beta2), static_cast<float>(eps), maximize};
  a.stochastic = stochastic_rounding;
  a.seed = static_cast<uint64_t>(seed);
  a.offset = static_cast<uint64_t>(offset);
  a.param_storage = Storage::kFloat;
  a.state_storage = Storage::kFloat;
  if (n == 0) return a;

  const at::Tensor& first = params[0];
  TORCH_CHECK(first.device().type() == device_type, "adamw_step_: params[0] must be a ", device_type,
              " tensor for this kernel, got ", first.device());
  const at::ScalarType param_dtype = first.scalar_type(), state_dtype = exp_avgs[0].scalar_type();
  a.param_storage = storage_of(param_dtype, "params");
  a.state_storage = storage_of(state_dtype, "exp_avgs");
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    TORCH_CHECK(p.device() == first.device(), "adamw_step_: all params must be on one device, params[0] is on ",
                first.device(), " and params[", i, "] on ", p.device());
    TORCH_CHECK(p.scalar_type() == param_dtype, "adamw_step_: all params must have one dtype, params[0] is ",
                param_dtype, " and params[", i, "] is ", p.scalar_type());
    TORCH_CHECK(p.is_contiguous(), "adamw_step_: params[", i, "] must be contiguous");
    TORCH_CHECK(p.layout() == at::kStrided, "adamw_step_: params[", i, "] must be a dense tensor");
    check_like(grads[i], p, param_dtype, "grads", i);
    check_like(exp_avgs[i], p, state_dtype, "exp_avgs", i);
    check_like(exp_avg_sqs[i], p, state_dtype, "exp_avg_sqs", i);
    const int64_t number = tensor_numbers.has_value() ? (*tensor_numbers)[i] : static_cast<int64_t>(i);
    const int64_t base = index_bases.has_value() ? (*index_bases)[i] : 0;
    TORCH_CHECK(number >= 0 && number < kMaxStreams / 3, "adamw_step_: tensor_numbers[", i, "] must be in [0, ",
                kMaxStreams / 3, "), got ", number);
    TORCH_CHECK(base >= 0 && base < (int64_t(1) << (kStreamShift + 2)) - p.numel(), "adamw_step_: index_bases[",
                i, "] must be >= 0 with index_bases[", i, "] + numel < 2^42 (the elements the random streams ",
                "allow), got ", base, " for ", p.numel(), " elements");
    TORCH_CHECK(steps[i] >= 1, "adamw_step_: steps[", i, "] must be >= 1 (the step being taken), got ", steps[i]);
    const double t = static_cast<double>(steps[i]);
    a.params.push_back(p.data_ptr());
    a.grads.push_back(grads[i].data_ptr());
    a.exp_avgs.push_back(exp_avgs[i].data_ptr());
    a.exp_avg_sqs.push_back(exp_avg_sqs[i].data_ptr());
    a.numel.push_back(p.numel());
    a.index_base.push_back(base);
    a.stream.push_back(static_cast<uint32_t>(3 * number));
    a.neg_step_size.push_back(static_cast<float>(-(lr / (1.0 - std::pow(beta1, t)))));
    a.bc2_sqrt.push_back(static_cast<float>(std::sqrt(1.0 - std::pow(beta2, t))));
  }
  return a;
}

}  // namespace clipshard
