#pragma once
// Host-side arguments of clipshard::adamw_step_, validated once and shared by the CPU and CUDA
// kernels: raw pointers, sizes, the fp32 scalars and the per-tensor bias corrections.
#include <ATen/ATen.h>

#include <type_traits>
#include <vector>

#include "clipshard/adamw.h"

namespace clipshard {

struct AdamWArgs {
  std::vector<void*> params, exp_avgs, exp_avg_sqs;
  std::vector<const void*> grads;
  std::vector<int64_t> numel;
  std::vector<int64_t> index_base;  // per tensor: global index of its element 0 (a shard's offset)
  std::vector<uint32_t> stream;     // per tensor: 3 * its tensor number (the stream of the param)
  std::vector<float> neg_step_size, bc2_sqrt;  // per tensor: -lr / (1 - beta1^t), sqrt(1 - beta2^t)
  AdamWHyper hyper;
  Storage param_storage, state_storage;
  bool stochastic;
  uint64_t seed, offset;
};

// Checks every argument (naming the op and the argument in errors) and collects them.
AdamWArgs make_adamw_args(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                          at::TensorList exp_avg_sqs, at::IntArrayRef steps, double lr, double beta1,
                          double beta2, double eps, double weight_decay, bool maximize,
                          bool stochastic_rounding, int64_t seed, int64_t offset,
                          at::OptionalIntArrayRef tensor_numbers, at::OptionalIntArrayRef index_bases,
                          at::DeviceType device_type);

// Calls fn(std::integral_constant<Storage, P>{}, std::integral_constant<Storage, S>{}).
template <typename Fn>
void dispatch_storage(Storage p, Storage s, Fn&& fn) {
  auto with_state = [&](auto pc) {
    switch (s) {
      case Storage::kFloat: return fn(pc, std::integral_constant<Storage, Storage::kFloat>{});
      case Storage::kHalf: return fn(pc, std::integral_constant<Storage, Storage::kHalf>{});
      case Storage::kBFloat16: return fn(pc, std::integral_constant<Storage, Storage::kBFloat16>{});
    }
  };
  switch (p) {
    case Storage::kFloat: return with_state(std::integral_constant<Storage, Storage::kFloat>{});
    case Storage::kHalf: return with_state(std::integral_constant<Storage, Storage::kHalf>{});
    case Storage::kBFloat16: return with_state(std::integral_constant<Storage, Storage::kBFloat16>{});
  }
}

}  // namespace clipshard
