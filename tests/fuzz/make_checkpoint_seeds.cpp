// Writes the fuzzer's seed corpus: two real checkpoints per configuration of
// tests/support/checkpoint_model.hpp, as <seeds>/<configuration>.ckpt (everything) and
// <seeds>/<configuration>.state.ckpt (the optimizer state alone). Also empties <corpus>, the
// directory the fuzzer adds its own inputs to, so that every run starts from the seeds alone.
//   usage: make_checkpoint_seeds <seeds> <corpus>
#include "../support/checkpoint_model.hpp"

#include <cstdio>
#include <exception>
#include <filesystem>

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s <seeds> <corpus>\n", argv[0]);
    return 2;
  }
  try {
    const std::filesystem::path seeds = argv[1], corpus = argv[2];
    std::filesystem::remove_all(seeds);
    std::filesystem::remove_all(corpus);
    std::filesystem::create_directories(seeds);
    std::filesystem::create_directories(corpus);
    for (const auto& c : zenflow::testing::checkpoint_configurations()) {
      zenflow::testing::checkpoint_model model(c);
      model.train(c.steps);
      for (const auto contents :
           {zenflow::checkpoint_contents::everything, zenflow::checkpoint_contents::optimizer_state}) {
        const bool everything = contents == zenflow::checkpoint_contents::everything;
        const auto path = (seeds / (std::string(c.name) + (everything ? ".ckpt" : ".state.ckpt"))).string();
        model.coordinator().save_checkpoint(path, &model.stream(), contents);
        std::printf("%s: %zu bytes after %lld steps\n", path.c_str(),
                    static_cast<std::size_t>(std::filesystem::file_size(path)), static_cast<long long>(c.steps));
      }
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "make_checkpoint_seeds: %s\n", e.what());
    return 1;
  }
  return 0;
}
