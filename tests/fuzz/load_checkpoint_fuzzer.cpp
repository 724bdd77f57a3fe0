// libFuzzer target: host_coordinator::load_checkpoint on arbitrary bytes.
//
// Per input, on a freshly constructed coordinator whose options match the input's options
// fingerprint (one of tests/support/checkpoint_model.hpp's configurations; the first otherwise):
//   1. the bytes as they are (exercises the header: size, magic, version, checksum, and the
//      fields: the load parses and validates them before it verifies the checksum); a file whose
//      header is intact but whose payload does not match its checksum must be rejected as
//      corrupted ("checksum mismatch"), whatever else is wrong with it;
//   2. if rejected, the same bytes with the header's size and checksum (of the header's version)
//      recomputed over the payload, so that mutated fields reach the field validation instead of
//      the checksum;
//   3. after every rejection the coordinator must be unchanged (no step, no GPU columns, optimizer
//      counts 0, the registered weights and CPU state); if both were rejected, the real checkpoint
//      of that configuration must then load into the same coordinator;
//   4. whatever was loaded must train one step and finish.
// Only zenflow::error may leave load_checkpoint; any other exception, a changed coordinator after
// a rejection, a crash, a hang (-timeout) or a leak (ASan) aborts the run.
#include "../support/checkpoint_model.hpp"

#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <string>
#include <vector>

namespace {

using namespace zenflow;
using namespace zenflow::testing;

constexpr std::size_t options_bytes = 40;  // the options fingerprint at the start of the payload

struct known_configuration {
  zenflow_options options;
  std::int64_t steps;
  std::vector<char> checkpoint;  // the real file of this configuration
};

[[noreturn]] void fail(const char* what, const std::string& detail = {}) {
  std::fprintf(stderr, "load_checkpoint_fuzzer: %s %s\n", what, detail.c_str());
  std::abort();
}

const std::string& scratch_path() {
  static const std::string path =
      (std::filesystem::temp_directory_path() / ("zenflow_fuzz_" + std::to_string(::getpid()) + ".ckpt")).string();
  return path;
}

const std::vector<known_configuration>& configurations() {
  static const std::vector<known_configuration> all = [] {
    std::vector<known_configuration> out;
    for (const auto& c : checkpoint_configurations()) {
      checkpoint_model m(c);
      m.train(c.steps);
      m.coordinator().save_checkpoint(scratch_path(), &m.stream());
      out.push_back({c.options, c.steps, read_file_bytes(scratch_path())});
    }
    return out;
  }();
  return all;
}

const known_configuration& matching(const std::vector<char>& file) {
  const std::size_t at = detail::checkpoint_header_bytes;
  for (const auto& c : configurations())
    if (file.size() >= at + options_bytes &&
        std::memcmp(file.data() + at, c.checkpoint.data() + at, options_bytes) == 0)
      return c;
  return configurations().front();
}

// True when `file`'s header is one the reader takes (magic, a version it reads, the payload's
// size) but the payload does not match the header's checksum.
bool corrupted(const std::vector<char>& file) {
  if (file.size() < detail::checkpoint_header_bytes || std::memcmp(file.data(), detail::checkpoint_magic, 8) != 0)
    return false;
  std::uint32_t version = 0;
  std::uint64_t size = 0, hash = 0;
  std::memcpy(&version, file.data() + 8, 4);
  std::memcpy(&size, file.data() + 16, 8);
  std::memcpy(&hash, file.data() + 24, 8);
  if (version < detail::checkpoint_oldest_version || version > detail::checkpoint_version ||
      size != file.size() - detail::checkpoint_header_bytes)
    return false;
  detail::checkpoint_checksum checksum(version);
  checksum.update({reinterpret_cast<const std::byte*>(file.data()) + detail::checkpoint_header_bytes, size});
  return checksum.value() != hash;
}

// Loads `file`; true if accepted. A rejection must leave `m` as constructed; a corrupted file
// must be rejected as such.
bool try_load(checkpoint_model& m, const std::vector<char>& file, const std::vector<std::byte>& weights,
              const std::vector<float>& cpu) {
  write_file_bytes(scratch_path(), file);
  const bool corrupt = corrupted(file);
  try {
    m.coordinator().load_checkpoint(scratch_path(), &m.stream());
    if (corrupt) fail("a file whose payload does not match its checksum was loaded");
    return true;
  } catch (const zenflow::error& e) {
    if (corrupt && std::strstr(e.what(), "checksum mismatch") == nullptr)
      fail("a corrupted file was rejected for another reason:", e.what());
  } catch (const std::exception& e) {
    fail("load_checkpoint threw something other than zenflow::error:", e.what());
  } catch (...) {
    fail("load_checkpoint threw a non-std exception");
  }
  auto& c = m.coordinator();
  if (c.step_count() != 0 || !c.gpu_columns(0).empty() || !c.gpu_columns(1).empty() ||
      c.host_optimizer().step_count() != 0 || c.device_optimizer().step_count() != 0)
    fail("a rejected file changed the coordinator's counters or selection");
  if (m.snapshot() != weights) fail("a rejected file changed the model's weights");
  if (m.cpu_state() != cpu) fail("a rejected file changed the CPU optimizer state");
  return false;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  (void)configurations();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::vector<char> file(reinterpret_cast<const char*>(data), reinterpret_cast<const char*>(data) + size);
  const auto& config = matching(file);
  checkpoint_model m(config.options);
  const auto weights = m.snapshot();
  const auto cpu = m.cpu_state();
  bool loaded = try_load(m, file, weights, cpu);
  if (!loaded) {
    auto resealed = file;
    reseal_checkpoint(resealed);
    if (resealed != file) loaded = try_load(m, resealed, weights, cpu);
  }
  if (!loaded && !try_load(m, config.checkpoint, weights, cpu))
    fail("the real checkpoint was rejected after a rejected file");
  try {
    m.train(1);
    m.coordinator().finish(&m.stream());
  } catch (const std::exception& e) {
    // A loaded state may hold NaN weights: their steps are skipped, nothing throws.
    fail("training after the load threw:", e.what());
  }
  return 0;
}
