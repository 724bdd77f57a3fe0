// The consumer's fmt code: zenflow/format.hpp through the zenflow::fmt target.
#include <zenflow/format.hpp>

#include <fmt/format.h>

int main() {
  const zenflow::zenflow_options options = zenflow::zenflow_options::zero_offload();
  fmt::print("zenflow options through fmt: {}\n", options);
  return fmt::format("{} {}", options.mode, zenflow::dtype::bf16) == "zero_offload bf16" ? 0 : 1;
}
