// The extension's environment variables (CLIPSHARD_*), read through these helpers so that every
// variable takes the same spellings and a value it does not know raises an error naming the
// variable, instead of being ignored (clipshard/ops/_algorithm.py does the same for
// CLIPSHARD_ALGORITHM). Unset and empty mean "not set".
#pragma once

#include <c10/util/Exception.h>

#include <cctype>
#include <cstddef>
#include <cstdlib>
#include <initializer_list>
#include <optional>
#include <string>

namespace clipshard::env {

// The value of `name` in lower case, or nullopt when it is unset or empty.
inline std::optional<std::string> read(const char* name) {
  const char* raw = std::getenv(name);
  if (raw == nullptr || *raw == '\0') return std::nullopt;
  std::string value(raw);
  for (char& c : value) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return value;
}

// The position of the variable's value in `choices` (lower case), or nullopt when it is not set.
inline std::optional<std::size_t> choice(const char* name, std::initializer_list<const char*> choices) {
  const auto value = read(name);
  if (!value) return std::nullopt;
  std::size_t position = 0;
  std::string known;
  for (const char* c : choices) {
    if (*value == c) return position;
    known += (position++ ? ", " : "") + std::string(c);
  }
  C10_THROW_ERROR(ValueError, c10::str("clipshard: the environment variable ", name, " must be one of ", known,
                                       " (or unset), got \"", std::getenv(name), "\""));
}

// A switch: 1, true, on, yes -> true; 0, false, off, no -> false (any case); nullopt when not set.
inline std::optional<bool> flag(const char* name) {
  const auto position = choice(name, {"1", "true", "on", "yes", "0", "false", "off", "no"});
  if (!position) return std::nullopt;
  return *position < 4;
}

}  // namespace clipshard::env
