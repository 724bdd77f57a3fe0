// coordinator_config::reserved_cpus: the coordinator's threads stay off the CPUs left to the
// trainer, the results do not change, and an impossible reservation is refused up front.
#include <zenflow/coordinator.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cstddef>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "coordinator_harness.hpp"

#if defined(__linux__)
#include <sched.h>
#endif

#include "../support/test_file_id.hpp"

namespace ZENFLOW_TEST_FILE_ID {  // this file's names (tests/support/test_file_id.hpp)

using namespace zenflow;
using namespace zenflow::testing;

#if defined(__linux__)
namespace {

// The threads of this process (their kernel ids).
std::set<int> thread_ids() {
  std::set<int> ids;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/task"))
    ids.insert(std::stoi(entry.path().filename().string()));
  return ids;
}

// Thread `tid`'s name ("" if it is gone).
std::string name_of(int tid) {
  std::ifstream in("/proc/self/task/" + std::to_string(tid) + "/comm");
  std::string name;
  std::getline(in, name);
  return name;
}

// The CPUs thread `tid` may run on, ascending (empty if it is gone).
std::vector<int> cpus_of(int tid) {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> cpus;
  if (sched_getaffinity(tid, sizeof set, &set) != 0) return cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &set)) cpus.push_back(c);
  return cpus;
}

}  // namespace

TEST_CASE("reserved_cpus: every thread the coordinator starts runs on the other CPUs") {
  const std::vector<int> allowed = detail::allowed_cpus();
  if (allowed.size() < 2) return;  // nothing can be reserved on one CPU
  const std::vector<int> rest(allowed.begin() + 1, allowed.end());
  for (const bool pin : {false, true}) {
    CAPTURE(pin);
    coordinator_config c;
    c.reserved_cpus = 1;
    c.pin_threads = pin;
    const std::set<int> before = thread_ids();
    {
      host_coordinator coordinator(base_options(), c);
      // The coordinator's CPU-side threads, by their names: the offload and update workers and
      // the workers of their pools (cpu_threads 0: one participant per unreserved CPU, the worker
      // thread itself one of them). The host backend's streams and copy engines are its device.
      std::multiset<std::string> names;
      std::vector<int> started;
      for (const int tid : thread_ids()) {
        const std::string name = name_of(tid);
        if (before.contains(tid) || !name.starts_with("zf-")) continue;
        names.insert(name);
        started.push_back(tid);
      }
      CHECK(names.count("zf-offload") == 1);
      CHECK(names.count("zf-update") == 1);
      CHECK(names.count("zf-accumulate") == rest.size() - 1);
      CHECK(names.count("zf-adam") == rest.size() - 1);
      CHECK(started.size() == 2 + 2 * (rest.size() - 1));
      for (const int tid : started) {
        CAPTURE(tid);
        const std::vector<int> cpus = cpus_of(tid);
        REQUIRE_FALSE(cpus.empty());
        CHECK(std::find(cpus.begin(), cpus.end(), allowed[0]) == cpus.end());  // never the trainer's CPU
        for (const int cpu : cpus) CHECK(std::find(rest.begin(), rest.end(), cpu) != rest.end());
        if (!pin) CHECK(cpus == rest);
      }
    }
  }
  // Unreserved (the default): the coordinator leaves its threads wherever the system puts them.
  const std::set<int> before = thread_ids();
  host_coordinator coordinator(base_options(), coordinator_config{});
  std::size_t workers = 0;
  for (const int tid : thread_ids())
    if (!before.contains(tid) && name_of(tid).starts_with("zf-")) {
      ++workers;
      CHECK(cpus_of(tid) == allowed);
    }
  CHECK(workers == 2 + 2 * (allowed.size() - 1));
}
#endif

TEST_CASE("reserved_cpus changes where the threads run, not the results") {
  const std::size_t cpus = detail::allowed_cpus().size();
  if (cpus < 2) return;
  auto zero_offload = base_options();
  zero_offload.mode = offload_mode::zero_offload;
  for (const auto& options : {base_options(), zero_offload}) {
    harness unreserved(options);
    unreserved.train(12);
    auto c = harness::small_config();
    c.reserved_cpus = cpus - 1;
    harness reserved(options, c);
    reserved.train(12);
    CHECK(reserved.finish() == unreserved.finish());
  }
}

TEST_CASE("reserved_cpus: a reservation that leaves the coordinator no CPU is refused, naming the field") {
  const std::size_t cpus = detail::allowed_cpus().size();
  coordinator_config c;
  for (const std::size_t reserved : {cpus, cpus + 5}) {
    c.reserved_cpus = reserved;
    const std::string reason = "must leave at least one of the " + std::to_string(cpus) + " CPUs";
    CHECK_THROWS_WITH_AS(host_coordinator(base_options(), c), doctest::Contains(reason.c_str()), error);
    try {
      host_coordinator coordinator(base_options(), c);
    } catch (const error& e) {
      CHECK(e.argument() == "reserved_cpus");
    }
  }
  cpu_adam_config a;
  a.cpus = {detail::allowed_cpus().back() + 1};
  CHECK_THROWS_WITH_AS(cpu_adam(adam_options{}, a), doctest::Contains("is not one this process may run on"), error);
  try {
    cpu_adam opt(adam_options{}, a);
  } catch (const error& e) {
    CHECK(e.argument() == "config.cpus");
  }
}

}  // namespace ZENFLOW_TEST_FILE_ID
