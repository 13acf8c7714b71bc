// The torch and CUDA versions this library was compiled against, as one string inside the file:
// clipshard/_build_record.py reads it from the file before loading the library, and refuses a
// library built for another torch release (docs/packaging.md). setup.py writes the header
// (build_support.write_build_record) into the build folder; `used` keeps the unreferenced string.
#include "clipshard_build_record.h"

extern "C" __attribute__((used, visibility("default"))) const char clipshard_build_record[] = CLIPSHARD_BUILD_RECORD;
