// Which implementation of a loss op runs: the op schemas take it as a string, resolved by the
// Python layer ("auto" -> "fused" on the CPU, "chunked" on CUDA; docs/fused_loss_cuda.md).
#pragma once

#include <c10/util/Exception.h>
#include <c10/util/string_view.h>

namespace clipshard {

enum class Algorithm { kFused, kChunked };

inline Algorithm parse_algorithm(const char* op, c10::string_view name) {
  if (name == "fused") return Algorithm::kFused;
  if (name == "chunked") return Algorithm::kChunked;
  TORCH_CHECK(false, op, ": algorithm must be \"fused\" or \"chunked\", got \"", std::string(name.data(), name.size()),
              "\"");
}

}  // namespace clipshard
