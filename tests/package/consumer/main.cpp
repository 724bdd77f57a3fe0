// The consumer's host code: compiled by the host compiler alone.
#include <zenflow/state_file.hpp>
#include <zenflow/zenflow.hpp>

#include <cstdio>
#include <filesystem>
#include <vector>

#if defined(CONSUMER_CUDA)
int consumer_kernel_compiled();  // defined in consumer_kernel.cu
#endif

int main() {
  zenflow::zenflow_options options;
  options.validate();
  float p = 1.0f, m = 0.0f, v = 0.0f;
  zenflow::adam_update(p, 0.5f, m, v, zenflow::make_adam_step_constants(options.optimizer, 1));
  const float half = zenflow::to_float(zenflow::to_float16(p));
  std::printf("zenflow %d.%d.%d consumer: p after one step %.6f (fp16 %.6f)\n", zenflow::version_major,
              zenflow::version_minor, zenflow::version_patch, p, half);
#if defined(CONSUMER_CUDA)
  std::printf("CUDA translation unit linked: %d\n", consumer_kernel_compiled());
#endif
  // The NVMe tier's storage, with io_uring when the consumer links zenflow::uring.
  zenflow::state_file_config cfg;
  cfg.directory = std::filesystem::current_path();
  cfg.bytes = 1 << 16;
  cfg.block_bytes = 1 << 14;
  cfg.pin = zenflow::pin_policy::none;
  zenflow::state_file file(cfg);
  const std::vector<std::byte> in(1000, std::byte{7});
  std::vector<std::byte> out(1000);
  file.write(123, in);
  file.read(123, out);
  std::printf("state file round trip %s on %s (io_uring built in: %d)\n", out == in ? "ok" : "FAILED",
              std::string(file.engine().name()).c_str(), static_cast<int>(zenflow::io_uring_built_in));
#if defined(CONSUMER_URING)
  if (!zenflow::io_uring_built_in) return 1;
#endif
  return p < 1.0f && out == in ? 0 : 1;
}
