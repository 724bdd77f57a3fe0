// The library's persistent thread pool.
#include <zenflow/thread_pool.hpp>

#include <doctest/doctest.h>

#include <atomic>
#include <stdexcept>
#include <thread>
#include <vector>

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
