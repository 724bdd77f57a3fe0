// The consumer's host code: compiled by the host compiler alone.
#include <zenflow/zenflow.hpp>

#include <cstdio>

#if defined(CONSUMER_CUDA)
int consumer_kernel_compiled();  // defined in consumer_kernel.cu
#endif

int main() {
  zenflow::zenflow_options options;
  options.validate();
  float p = 1.0f, m = 0.0f, v = 0.0f;
  zenflow::adam_update(p, 0.5f, m, v, zenflow::make_adam_step_constants(options.adam, 1));
  const float half = zenflow::to_float(zenflow::to_float16(p));
  std::printf("zenflow %d.%d.%d consumer: p after one step %.6f (fp16 %.6f)\n", zenflow::version_major,
              zenflow::version_minor, zenflow::version_patch, p, half);
#if defined(CONSUMER_CUDA)
  std::printf("CUDA translation unit linked: %d\n", consumer_kernel_compiled());
#endif
  return p < 1.0f ? 0 : 1;
}
