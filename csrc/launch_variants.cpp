// Internal ops that answer which compiled CUDA kernel variant a call would run, by the very rules
// the CUDA launchers use (clipshard/launch_rules.h, csrc/chunked/forward_rows.h). They take sizes,
// not tensors, and run on any machine: the first-use check (clipshard/ops/first_use.py) keys its
// verdicts by their answers and builds each probe so that it runs the variant it checks. One more
// sizing rule of the chunk driver is answered the same way, for the memory planner's workspace rules.
#include <torch/library.h>

#include <vector>

#include "chunked/chunk_driver.h"
#include "chunked/forward_rows.h"
#include "clipshard/launch_rules.h"

namespace {

using namespace clipshard;

int64_t chunked_forward_rows_per_cta_op(int64_t rows) { return chunked::forward_rows_per_cta(rows); }

int64_t siglip_ids_rows_per_cta_op(int64_t rows, int64_t multiprocessors) {
  TORCH_CHECK(multiprocessors > 0, "_siglip_ids_rows_per_cta: multiprocessors must be positive, got ",
              multiprocessors);
  return launch_rules::siglip_ids_rows_per_cta(rows, multiprocessors, launch_rules::kSiglipMaxIdRows);
}

// The distinct teacher counts of the forward launches for T teachers, in launch order.
std::vector<int64_t> distill_launch_teachers_op(int64_t teachers) {
  TORCH_CHECK(teachers > 0, "_distill_launch_teachers: teachers must be positive, got ", teachers);
  std::vector<int64_t> counts;
  for (int64_t first = 0; first < teachers; first += launch_rules::kDistillMaxLaunchTeachers) {
    const int64_t n = launch_rules::distill_launch_teachers(teachers, first);
    if (counts.empty() || counts.back() != n) counts.push_back(n);
  }
  return counts;
}

int64_t column_buffer_rows_op(int64_t m, int64_t width) { return chunked::column_buffer_rows(m, width); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(clipshard, m) {
  // Rows per CTA of the chunked contrastive forward kernel (16 or 32) for M rows.
  m.def("_chunked_forward_rows_per_cta(int rows) -> int", &chunked_forward_rows_per_cta_op);
  // Rows per CTA (1, 2, 4 or 8) of SigLIP's kernel with sample ids for M rows on a GPU with that many SMs.
  m.def("_siglip_ids_rows_per_cta(int rows, int multiprocessors) -> int", &siglip_ids_rows_per_cta_op);
  // Teachers per launch of distill_forward_kernel<n> for T teachers: the distinct n, in launch order.
  m.def("_distill_launch_teachers(int teachers) -> int[]", &distill_launch_teachers_op);
  // Columns per block of the chunk driver's fp32 buffer of the columns' gradient, for M rows and
  // chunks of at most `width` columns (GradientAccumulator in csrc/chunked/chunk_driver.h).
  m.def("_column_buffer_rows(int m, int width) -> int", &column_buffer_rows_op);
}
