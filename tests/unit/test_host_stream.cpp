// host_stream / host_event: ordering, cross-stream waits, sticky errors, clean shutdown.
#include <zenflow/host_stream.hpp>

#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <stdexcept>
#include <thread>
#include <vector>

#include "../support/test_file_id.hpp"

namespace ZENFLOW_TEST_FILE_ID {  // this file's names (tests/support/test_file_id.hpp)

using namespace std::chrono_literals;

TEST_CASE("work runs in order, asynchronously, and synchronize waits for it") {
  zenflow::host_stream s;
  std::vector<int> order;
  std::atomic<bool> release{false};
  s.enqueue([&] {
    while (!release) std::this_thread::sleep_for(1ms);
    order.push_back(0);
  });
  for (int i = 1; i < 100; ++i) s.enqueue([&order, i] { order.push_back(i); });
  CHECK(!s.query());  // the first task is still blocked: enqueue did not wait
  release = true;
  s.synchronize();
  REQUIRE(order.size() == 100);
  for (int i = 0; i < 100; ++i) CHECK(order[i] == i);
  CHECK(s.query());
}

TEST_CASE("an event orders work across streams without blocking the caller") {
  zenflow::host_stream producer, consumer;
  zenflow::host_event ready;
  std::atomic<int> value{0};
  std::atomic<bool> go{false};
  producer.enqueue([&] {
    while (!go) std::this_thread::sleep_for(1ms);
    value = 42;
  });
  ready.record(producer);
  CHECK(!ready.query());
  int seen = -1;
  consumer.wait(ready);
  consumer.enqueue([&] { seen = value.load(); });
  std::this_thread::sleep_for(5ms);
  CHECK(seen == -1);  // the consumer is held back by the event
  go = true;
  consumer.synchronize();
  CHECK(seen == 42);
  ready.synchronize();
  CHECK(ready.query());
  zenflow::host_event never_recorded;
  CHECK(never_recorded.query());
  never_recorded.synchronize();
}

TEST_CASE("errors are sticky, reach the caller once, and release event waiters") {
  zenflow::host_stream s;
  int ran_after_error = 0;
  s.enqueue([] { throw std::runtime_error("kernel failed"); });
  s.enqueue([&] { ++ran_after_error; });
  zenflow::host_event e;
  e.record(s);
  CHECK_THROWS_WITH_AS(e.synchronize(), "kernel failed", std::runtime_error);
  CHECK_THROWS_WITH_AS(s.synchronize(), "kernel failed", std::runtime_error);
  CHECK(ran_after_error == 0);
  s.synchronize();  // cleared: the stream is usable again
  s.enqueue([&] { ++ran_after_error; });
  e.record(s);
  e.synchronize();  // a fresh record without an error does not rethrow the old one
  CHECK(ran_after_error == 1);

  // A stream waiting on a failed event inherits the error.
  zenflow::host_stream a, b;
  zenflow::host_event failed;
  a.enqueue([] { throw std::logic_error("upstream"); });
  failed.record(a);
  b.wait(failed);
  CHECK_THROWS_AS(b.synchronize(), std::logic_error);
  CHECK_THROWS_AS(a.synchronize(), std::logic_error);
  CHECK_THROWS_AS(s.enqueue({}), zenflow::error);
}

TEST_CASE("destruction with work in flight drains it") {
  std::atomic<int> done{0};
  {
    zenflow::host_stream s;
    for (int i = 0; i < 50; ++i)
      s.enqueue([&] {
        std::this_thread::sleep_for(100us);
        ++done;
      });
  }
  CHECK(done == 50);
}

}  // namespace ZENFLOW_TEST_FILE_ID
