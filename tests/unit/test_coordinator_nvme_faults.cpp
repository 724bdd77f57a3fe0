// Faults of the NVMe state tier under a coordinator (coordinator_config::nvme), in forked
// children: a state-file write that fails for real mid-run (RLIMIT_FSIZE) fails the coordinator
// with the file and errno, and a process killed with SIGKILL mid-run leaves a stale scratch file;
// either way the checkpoint saved before loads into a fresh coordinator on disk and resumes
// bit-identically to a run that was never interrupted.
#include <signal.h>
#include <sys/resource.h>

#include <zenflow/coordinator.hpp>

#include "../support/error_text.hpp"
#include "../support/storage_test_utils.hpp"
#include "coordinator_harness.hpp"

#include <doctest/doctest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "../support/test_file_id.hpp"

namespace ZENFLOW_TEST_FILE_ID {  // this file's names (tests/support/test_file_id.hpp)

using namespace zenflow;
using namespace zenflow::testing;
using zenflow_test::contains;

namespace {

constexpr std::int64_t before_checkpoint = 6, after_checkpoint = 8;

zenflow_options fault_options() {
  zenflow_options o;
  o.optimizer.lr = 0.01f;
  o.topk_ratio = 0.25f;
  o.select_interval = interval_option::fixed(3);
  o.update_interval = interval_option::fixed(2);
  return o;
}

coordinator_config disk_config(const std::filesystem::path& dir) {
  return harness::on_disk(dir, 1);
}

// The weights after before_checkpoint + after_checkpoint steps with the state in RAM, never
// interrupted.
std::vector<std::byte> uninterrupted() {
  harness h(fault_options());
  h.train(before_checkpoint + after_checkpoint);
  return h.finish();
}

// A fresh coordinator with its moments on disk in `dir` loads `checkpoint` and trains the rest.
std::vector<std::byte> resumed(const std::filesystem::path& dir, const std::string& checkpoint) {
  harness h(fault_options(), disk_config(dir));
  h.coordinator.load_checkpoint(checkpoint, &h.stream);
  h.train(after_checkpoint);
  return h.finish();
}

}  // namespace

TEST_CASE("moments on disk: a state-file write that fails mid-run fails the coordinator; the checkpoint resumes") {
  zenflow_test::scratch_dir dir;
  const std::string checkpoint = (dir.path() / "before.ckpt").string();
  const auto r = zenflow_test::run_in_child([&](const auto& report) {
    ::signal(SIGXFSZ, SIG_IGN);
    harness h(fault_options(), disk_config(dir.path()));
    h.train(before_checkpoint);
    h.coordinator.save_checkpoint(checkpoint, &h.stream);
    const rlimit limit{0, 0};  // from now on every write to a file fails with EFBIG
    if (::setrlimit(RLIMIT_FSIZE, &limit) != 0) return 10;
    try {
      h.train(after_checkpoint);
      h.finish();
    } catch (const error& e) {
      report(e.what());
      return 0;
    }
    return 11;  // trained on without its moments
  });
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  CHECK(contains(r.output, (dir.path() / "zenflow_state.rank0.bin").string()));
  CHECK(contains(r.output, "File too large"));
  CHECK(std::filesystem::is_empty(dir.path()) == false);  // the checkpoint; the child removed its state file
  CHECK_FALSE(std::filesystem::exists(dir.path() / "zenflow_state.rank0.bin"));
  CHECK(resumed(dir.path(), checkpoint) == uninterrupted());
}

TEST_CASE("moments on disk: a process killed mid-run leaves a scratch file; the checkpoint resumes over it") {
  zenflow_test::scratch_dir dir;
  const std::string checkpoint = (dir.path() / "before.ckpt").string();
  const auto r = zenflow_test::run_in_child(
      [&](const auto& report) {
        harness h(fault_options(), disk_config(dir.path()));
        h.train(before_checkpoint);
        h.coordinator.save_checkpoint(checkpoint, &h.stream);
        report("saved\n");
        for (int i = 0; i < 1000000; ++i) h.train(1);  // until killed; a CPU update every other step
        return 12;
      },
      "saved", 20);
  INFO(r.output);
  REQUIRE(r.signal == SIGKILL);
  CHECK(std::filesystem::exists(dir.path() / "zenflow_state.rank0.bin"));  // stale: nobody removed it
  CHECK(resumed(dir.path(), checkpoint) == uninterrupted());
  CHECK_FALSE(std::filesystem::exists(dir.path() / "zenflow_state.rank0.bin"));  // the resumed run's, removed
}

}  // namespace ZENFLOW_TEST_FILE_ID
