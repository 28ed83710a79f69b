// Macros that let one header serve host C++ and CUDA device code.
#pragma once

#if defined(__CUDACC__)
#define TWELL_HD __host__ __device__ __forceinline__
#else
#define TWELL_HD inline
#endif
