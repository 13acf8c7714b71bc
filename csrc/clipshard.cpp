// Operator schemas of clipshard (the kernels live in csrc/cpu and csrc/cuda), and the Python module
// stub that lets `import clipshard._C` load them.
#include <Python.h>
#include <torch/library.h>

extern "C" {
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
}

TORCH_LIBRARY(clipshard, m) {
  // Stochastic rounding of fp32 to fp16/bf16 (docs/stochastic_rounding.md). `seed` and `offset`
  // are the Philox key and counter high word, passed as int64 bit patterns of uint64 values.
  m.def("stochastic_round(Tensor src, ScalarType dtype, int seed, int offset, bool saturate) -> Tensor");
  m.def("stochastic_round_into(Tensor(a!) dst, Tensor src, int seed, int offset, bool saturate) -> ()");

  // One AdamW step over lists of tensors sharing a device, a param dtype (fp32/fp16/bf16) and a state
  // dtype (docs/optimizer.md). Updates params, exp_avgs and exp_avg_sqs in place; steps[i] is the
  // step being taken for tensor i (>= 1). fp16 exp_avg_sqs hold v^(1/4). 16-bit outputs are rounded
  // stochastically with Philox(seed, offset), one stream per (tensor number, role), or to nearest
  // even. tensor_numbers (distinct; default 0, 1, ...) and index_bases (default 0) place each tensor
  // in the random streams: a shard of a larger parameter passes the parameter's number and the
  // global index of its first element, and draws the bits the unsharded parameter would.
  m.def(
      "adamw_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
      "int[] steps, float lr, float beta1, float beta2, float eps, float weight_decay, bool maximize, "
      "bool stochastic_rounding, int seed, int offset, int[]? tensor_numbers=None, "
      "int[]? index_bases=None) -> ()");

  // Fused similarity + online log-sum-exp (docs/fused_loss.md). S = scale * rows @ cols^T (+ bias).
  // Forward: row_lse[i] = logsumexp_j S[i, j]; pos_logit[i] = S[i, pos_offset + i]; col_lse[j] =
  // logsumexp_i S[i, j] over these rows when want_col_lse, else an empty tensor. Never stores S.
  // algorithm: "fused" (tile kernels: the CPU default) or "chunked" (GEMMs over column chunks with
  // fused elementwise kernels, an O(M x Kc) workspace of at most about workspace_bytes: the CUDA
  // default; docs/fused_loss_cuda.md). Every path is deterministic (no float atomics, fixed
  // reduction order). pos_offset == -1: no positives (pos_logit is NaN). row_ids [M] / col_ids [K]
  // (int64, both or neither): pairs with row_ids[i] == col_ids[j] other than the positive j ==
  // pos_offset + i are excluded from both LSEs (as if S[i, j] = -inf) and get dS = 0; the CUDA
  // "fused" kernels refuse ids.
  m.def(
      "contrastive_lse_forward(Tensor rows, Tensor cols, Tensor scale, Tensor? bias, int pos_offset, "
      "Tensor? row_ids, Tensor? col_ids, bool want_col_lse, str algorithm, int workspace_bytes) -> (Tensor row_lse, "
      "Tensor pos_logit, Tensor col_lse)");
  // Backward: dS[i, j] = grad_row_lse[i] * exp(S[i, j] - row_lse[i])
  //                    + grad_col_lse[j] * exp(S[i, j] - col_lse[j]) + grad_pos_logit[i] * [j == pos(i)]
  // (0 at the pairs that ids exclude),
  // recomputed tile by tile; returns (d rows, d cols, d scale, d bias).
  m.def(
      "contrastive_lse_backward(Tensor grad_row_lse, Tensor grad_pos_logit, Tensor? grad_col_lse, "
      "Tensor rows, Tensor cols, Tensor scale, Tensor? bias, int pos_offset, Tensor? row_ids, "
      "Tensor? col_ids, Tensor row_lse, Tensor? col_lse, str algorithm, int workspace_bytes) -> (Tensor grad_rows, "
      "Tensor grad_cols, Tensor grad_scale, Tensor grad_bias)");

  // SigLIP (docs/siglip.md): loss_sum = sum_{i < M, j < K} softplus(-z_ij * l_ij) with l_ij = scale *
  // rows_i . cols_j (+ bias) and z_ij = +1 iff j == pos_offset + i, else -1 (pos_offset = None: no
  // positives, every z_ij = -1: a foreign block of the SigLIP ring); 0-dim, fp32 (fp64 for fp64 inputs).
  // Labels by sample id (row_ids [M], col_ids [K], int64, both or neither): a pair other than the
  // positive with row_ids[i] == col_ids[j] has no term at all when mask_same_ids (neither loss nor
  // gradient), else z_ij = +1; without ids, the bits of the op without them. With with_grad the
  // same chunked pass also returns d loss_sum / d (rows, cols, scale, bias) for a unit upstream
  // gradient, in the inputs' dtypes except fp32 for fp16 features, whose range the sum's gradient
  // can exceed (empty tensors without with_grad, and for an absent bias): there is no normaliser,
  // so the gradient is known in the forward.
  // Memory beyond inputs and outputs: an O(M x Kc) workspace of at most about workspace_bytes.
  m.def(
      "siglip_forward(Tensor rows, Tensor cols, Tensor scale, Tensor? bias, int? pos_offset, Tensor? row_ids, "
      "Tensor? col_ids, bool mask_same_ids, bool with_grad, int workspace_bytes) -> (Tensor loss_sum, "
      "Tensor grad_rows, Tensor grad_cols, Tensor grad_scale, Tensor grad_bias)");

  // Fused distillation statistics (docs/distillation_cuda.md). Student logits s_ij = scale * rows_i .
  // cols_j, teacher logits t^k_ij = teacher_scale[k] * teacher_rows[k, i] . teacher_cols[k, j] for the
  // T stacked teachers, P^k / Q^k the teachers' row / column softmaxes. Forward: row_lse = logsumexp_j
  // s_ij, pos_logit = s_{i, i + pos_offset}, teacher_row_lse (T, M) = logsumexp_j t^k_ij, row_cross
  // (T, M) = sum_j P^k_ij s_ij; with want_columns the same over the M rows for each column (col_lse,
  // teacher_col_lse, col_cross; else empty (0,) / (T, 0) tensors). Outputs fp32 (fp64 for fp64 rows).
  // The backward is the exact vector-Jacobian product of every output (any upstream gradient may be
  // None); without teacher_grad the three teacher gradients are empty tensors and dT is never formed.
  // Never stores an M x K matrix: workspace_bytes bounds the per-chunk workspace (CUDA: the chunk of
  // logits; CPU: the per-thread column-gradient accumulators of the backward).
  m.def(
      "distill_lse(Tensor rows, Tensor cols, Tensor teacher_rows, Tensor teacher_cols, Tensor scale, "
      "Tensor teacher_scale, int pos_offset, bool want_columns, int workspace_bytes) -> (Tensor row_lse, "
      "Tensor pos_logit, Tensor teacher_row_lse, Tensor row_cross, Tensor col_lse, Tensor teacher_col_lse, "
      "Tensor col_cross)");
  m.def(
      "distill_lse_backward(Tensor? grad_row_lse, Tensor? grad_pos_logit, Tensor? grad_teacher_row_lse, "
      "Tensor? grad_row_cross, Tensor? grad_col_lse, Tensor? grad_teacher_col_lse, Tensor? grad_col_cross, "
      "Tensor rows, Tensor cols, Tensor teacher_rows, Tensor teacher_cols, Tensor scale, Tensor teacher_scale, "
      "int pos_offset, Tensor row_lse, Tensor teacher_row_lse, Tensor row_cross, Tensor col_lse, "
      "Tensor teacher_col_lse, Tensor col_cross, bool teacher_grad, int workspace_bytes) -> (Tensor grad_rows, "
      "Tensor grad_cols, Tensor grad_teacher_rows, Tensor grad_teacher_cols, Tensor grad_scale, "
      "Tensor grad_teacher_scale)");
}

// Ops that only the tests call, in their own namespace so that torch.ops.clipshard holds the
// production ops alone.
TORCH_LIBRARY(clipshard_testing, m) {
  // n random words of stochastic_round's stream as int32 (CPU tensor), starting at block
  // first_block: word i is word (i mod 4) of Philox4x32-10(key = seed, counter = (first_block +
  // i div 4, offset)), from the CPU kernel's batch generator (source="kernel"), from philox_block
  // of the shared header ("header", what the CUDA kernel uses) or from ATen's at::Philox4_32 ("aten").
  m.def("philox_words(int seed, int offset, int n, int first_block=0, str source=\"kernel\") -> Tensor");
}
