// A coordinator works on the device that was current when it was constructed, whatever device is
// current when it is called later (zenflow.torch constructs it under the parameters' device;
// a trainer may drive several GPUs from one thread and switch between them). The host twin of
// cuda_backend's device_scope: a host backend with a pretend current device per thread, which
// every "device" operation checks, and whose device_scope switches it.
#include <zenflow/communicator.hpp>
#include <zenflow/coordinator.hpp>

#include <doctest/doctest.h>

#include <unistd.h>
#include <atomic>
#include <cstdio>
#include <string>

#include "../support/data_parallel_model.hpp"

#include "../support/test_file_id.hpp"

namespace ZENFLOW_TEST_FILE_ID {  // this file's names (tests/support/test_file_id.hpp)

using zenflow::host_backend;
using zenflow::host_stream;

namespace {

// The host backend with a current "device" per thread: a device operation made while another
// device than the coordinator's is current counts as wrong.
struct device_backend : host_backend {
  static inline thread_local int current = 0;
  static inline std::atomic<int> coordinator_device{0};
  static inline std::atomic<int> wrong{0};

  static int current_device() noexcept { return current; }
  static void bind_device(int device) noexcept { current = device; }
  class device_scope {
   public:
    explicit device_scope(int device) : previous_(current) { current = device; }
    device_scope(const device_scope&) = delete;
    device_scope& operator=(const device_scope&) = delete;
    ~device_scope() { current = previous_; }

   private:
    int previous_;
  };

  static void seen() {
    if (current != coordinator_device) ++wrong;
  }
  static void record(event_type& event, stream_type stream) {
    seen();
    host_backend::record(event, stream);
  }
  static void wait(stream_type stream, const event_type& event) {
    seen();
    host_backend::wait(stream, event);
  }
  static void synchronize(const event_type& event) {
    seen();
    host_backend::synchronize(event);
  }
  static void synchronize(stream_type stream) {
    seen();
    host_backend::synchronize(stream);
  }
  static void copy_async(void* dst, const void* src, std::size_t bytes, stream_type stream) {
    seen();
    host_backend::copy_async(dst, src, bytes, stream);
  }
  static void step_statistics(std::span<const zenflow::const_matrix_view> m,
                              std::span<const zenflow::const_vector_view> v, float max_norm, zenflow::step_flags* f,
                              zenflow::step_flags* fh, std::byte* scratch, stream_type stream) {
    seen();
    host_backend::step_statistics(m, v, max_norm, f, fh, scratch, stream);
  }
  static void device_step(device_optimizer_type& opt, std::span<const zenflow::const_matrix_view> m,
                          std::span<const zenflow::const_vector_view> v, const zenflow::step_flags* f,
                          stream_type stream) {
    seen();
    host_backend::device_step(opt, m, v, f, stream);
  }
  static void gather(zenflow::const_matrix_view grad, std::span<const std::int32_t> columns,
                     const std::int32_t* columns_dev, void* dst, zenflow::dtype type, const zenflow::step_flags* f,
                     stream_type stream) {
    seen();
    host_backend::gather(grad, columns, columns_dev, dst, type, f, stream);
  }
  static void scatter(const void* src, zenflow::dtype type, std::span<const std::int32_t> columns,
                      const std::int32_t* columns_dev, zenflow::matrix_view param, stream_type stream) {
    seen();
    host_backend::scatter(src, type, columns, columns_dev, param, stream);
  }
  static std::size_t add_matrix(device_optimizer_type& opt, zenflow::matrix_view param,
                                std::span<const std::int32_t> selection, std::span<const float> packed,
                                stream_type stream) {
    seen();
    return host_backend::add_matrix(opt, param, selection, packed, stream);
  }
  static std::size_t add_vector(device_optimizer_type& opt, zenflow::vector_view param,
                                std::span<const float> initial) {
    seen();
    return host_backend::add_vector(opt, param, initial);
  }
  static void reselect(device_optimizer_type& opt, std::size_t i, std::span<const std::int32_t> selection,
                       std::span<const float> entering, std::span<float> leaving, stream_type stream) {
    seen();
    host_backend::reselect(opt, i, selection, entering, leaving, stream);
  }
  template <class Selector>
  static void select(Selector& selector, std::span<const zenflow::const_matrix_view> grads, stream_type stream) {
    seen();
    host_backend::select(selector, grads, stream);
  }
};

using model = zenflow_test::data_parallel_model;

// Every public call of `c`, made while device 0 is current, runs on device 1 (the coordinator's)
// and leaves device 0 current.
template <class Coordinator>
void train_on_another_device(Coordinator& c, model& m, const std::string& checkpoint) {
  host_stream s;
  device_backend::current = 0;
  m.register_with(c);
  CHECK(device_backend::current == 0);
  for (int t = 0; t < 8; ++t) {
    s.synchronize();
    m.make_gradients(t, 0, 1);
    m.submit(c, &s, !zenflow_test::w2_missing(t));
    CHECK(device_backend::current == 0);
    c.step(&s, zenflow::missing_gradients::skip);
    CHECK(device_backend::current == 0);
    if (t == 4) {
      c.save_checkpoint(checkpoint, &s);
      CHECK(device_backend::current == 0);
    }
  }
  c.finish(&s);
  (void)c.gpu_step_count(0);
  CHECK(device_backend::current == 0);
}

}  // namespace

TEST_CASE("every public call of a coordinator runs on its device, and leaves the caller's current") {
  const std::string path = "/tmp/zenflow_device_" + std::to_string(getpid()) + ".ckpt";
  const auto options = zenflow_test::data_parallel_test_options(0.5f);
  device_backend::wrong = 0;
  device_backend::coordinator_device = 1;
  SUBCASE("one process") {
    model m;
    device_backend::current = 1;
    auto c = std::make_unique<zenflow::basic_coordinator<device_backend>>(options);
    train_on_another_device(*c, m, path);
    model again;
    device_backend::current = 1;
    zenflow::basic_coordinator<device_backend> loaded(options);
    device_backend::current = 0;
    again.register_with(loaded);
    host_stream s;
    loaded.load_checkpoint(path, &s);
    CHECK(device_backend::current == 0);
    c.reset();  // destroyed while device 0 is current
    CHECK(device_backend::current == 0);
  }
  SUBCASE("one rank of a data-parallel group") {
    zenflow::self_communicator comm;
    model m;
    device_backend::current = 1;
    zenflow::basic_coordinator<device_backend, zenflow::cpu_adam, zenflow::self_communicator> c(comm, options);
    train_on_another_device(c, m, path);
  }
  CHECK(device_backend::wrong.load() == 0);
  device_backend::current = 0;
  std::remove(path.c_str());
}

}  // namespace ZENFLOW_TEST_FILE_ID
