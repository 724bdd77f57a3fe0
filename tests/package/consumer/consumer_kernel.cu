// The consumer's CUDA translation unit: compiled by nvcc against the installed headers.
#include <zenflow/zenflow.hpp>

__global__ void consumer_adam(float* p, const float* g, float* m, float* v, zenflow::adam_step_constants c, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) zenflow::adam_update(p[i], g[i], m[i], v[i], c);
}

// Only proves the kernel compiled and linked; launching it needs a GPU, which CI lacks.
int consumer_kernel_compiled() { return consumer_adam != nullptr ? 1 : 0; }
