// The library's persistent thread pool.
#include <zenflow/thread_pool.hpp>

#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <sched.h>
#endif

#include "../support/test_file_id.hpp"

namespace ZENFLOW_TEST_FILE_ID {  // this file's names (tests/support/test_file_id.hpp)

TEST_CASE("parallel_for runs every task exactly once, for any pool size") {
  for (std::size_t threads : {1u, 2u, 3u, 8u}) {
    zenflow::thread_pool pool(threads);
    CHECK(pool.size() == threads);
    for (std::size_t tasks : {0u, 1u, 2u, 5u, 1000u}) {
      std::vector<std::atomic<int>> hits(tasks);
      for (int round = 0; round < 3; ++round) pool.parallel_for(tasks, [&](std::size_t i) { hits[i].fetch_add(1); });
      for (auto& h : hits) CHECK(h.load() == 3);
    }
  }
}

TEST_CASE("the default size is the CPUs this process may run on") {
  zenflow::thread_pool pool;
  CHECK(pool.size() == zenflow::detail::allowed_cpus().size());
  zenflow::thread_pool pinned(2, true);  // pinning is best effort and must not break anything
  std::atomic<int> sum{0};
  pinned.parallel_for(10, [&](std::size_t i) { sum += static_cast<int>(i); });
  CHECK(sum.load() == 45);
}

#if defined(__linux__)
TEST_CASE("cpus: the workers run on the listed CPUs only; 0 threads means one per listed CPU") {
  const std::vector<int> allowed = zenflow::detail::allowed_cpus();
  const std::vector<int> last{allowed.back()};
  for (bool pin : {false, true}) {
    zenflow::thread_pool pool(3, pin, last);
    CHECK(pool.cpus() == last);
    const auto caller = std::this_thread::get_id();
    std::mutex m;
    std::vector<std::vector<int>> seen;  // each task's CPUs, on the workers (the caller is not restricted)
    pool.parallel_for(64, [&](std::size_t) {
      std::this_thread::sleep_for(std::chrono::microseconds(200));  // every participant gets tasks
      if (std::this_thread::get_id() == caller) return;
      cpu_set_t set;
      CPU_ZERO(&set);
      REQUIRE(sched_getaffinity(0, sizeof set, &set) == 0);
      std::vector<int> cpus;
      for (int c = 0; c < CPU_SETSIZE; ++c)
        if (CPU_ISSET(c, &set)) cpus.push_back(c);
      std::lock_guard lock(m);
      seen.push_back(cpus);
    });
    CHECK_FALSE(seen.empty());
    for (const auto& cpus : seen) CHECK(cpus == last);
  }
  CHECK(zenflow::thread_pool(0, false, last).size() == 1);
  CHECK(zenflow::thread_pool(0, false, allowed).size() == allowed.size());
  CHECK(zenflow::thread_pool().cpus().empty());  // unrestricted
}

TEST_CASE("cpus: a CPU this process may not run on, or one listed twice, is refused") {
  const std::vector<int> allowed = zenflow::detail::allowed_cpus();
  CHECK_THROWS_WITH_AS(zenflow::thread_pool(2, false, {allowed.back() + 1}),
                       doctest::Contains("is not one this process may run on"), zenflow::error);
  CHECK_THROWS_WITH_AS(zenflow::thread_pool(2, false, {-1}), doctest::Contains("CPU -1 is not one"), zenflow::error);
  const std::string twice = "CPU " + std::to_string(allowed[0]) + " is listed twice";
  CHECK_THROWS_WITH_AS(zenflow::thread_pool(2, false, {allowed[0], allowed[0]}), doctest::Contains(twice.c_str()),
                       zenflow::error);
  try {
    zenflow::thread_pool(2, false, {allowed.back() + 1});
  } catch (const zenflow::error& e) {
    CHECK(e.argument() == "cpus");
  }
}
#endif

TEST_CASE("the first exception of a task reaches the caller and the pool stays usable") {
  zenflow::thread_pool pool(3);
  CHECK_THROWS_AS(pool.parallel_for(100,
                                    [](std::size_t i) {
                                      if (i == 17) throw std::runtime_error("task 17");
                                    }),
                  std::runtime_error);
  std::atomic<int> count{0};
  pool.parallel_for(50, [&](std::size_t) { ++count; });
  CHECK(count.load() == 50);
}

TEST_CASE("nested calls run inline and concurrent callers are serialized") {
  zenflow::thread_pool pool(4);
  std::atomic<int> inner{0};
  pool.parallel_for(8, [&](std::size_t) { pool.parallel_for(4, [&](std::size_t) { ++inner; }); });
  CHECK(inner.load() == 32);

  std::atomic<long> total{0};
  auto caller = [&] {
    for (int r = 0; r < 20; ++r) pool.parallel_for(64, [&](std::size_t i) { total += static_cast<long>(i); });
  };
  std::thread a(caller), b(caller);
  a.join();
  b.join();
  CHECK(total.load() == 2L * 20 * (63 * 64 / 2));
}

}  // namespace ZENFLOW_TEST_FILE_ID
