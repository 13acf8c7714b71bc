#pragma once
// HOST_DEVICE for helpers compiled into both the CPU (g++) and the CUDA (nvcc) kernels.
#if defined(__CUDACC__)
#define CLIPSHARD_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define CLIPSHARD_HOST_DEVICE inline
#endif
