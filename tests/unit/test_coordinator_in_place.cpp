// The host backend's in-place CPU update: a step that is its interval's only one and whose CPU
// update completes within step() reads a column-contiguous fp32 gradient where the trainer left it
// and writes the updated columns straight into the parameter, with no accumulator, write-back
// staging or scatter. Its results must be the staged path's, bit for bit, in every mode that
// reaches it (ZeRO-Offload, warm-up, ZenFlow without overlap) and with clipping, a skipped step,
// a bf16 parameter and compact CPU state. Such a parameter in ZeRO-Offload needs neither
// accumulator nor write-back staging: it gets them only when a step cannot run in place.
#include <zenflow/coordinator.hpp>

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "../support/coordinator_instances.hpp"
#include "../support/test_file_id.hpp"

namespace ZENFLOW_TEST_FILE_ID {  // this file's names (tests/support/test_file_id.hpp)

using namespace zenflow;

namespace {

constexpr index_t rows = 24, cols = 40;
constexpr std::int64_t steps = 9, poisoned_step = 4;
constexpr unsigned char padding_byte = 0xA5;

// One column-contiguous weight with `ld` elements between its columns' starts (ld == rows: the
// in-place layout; ld > rows: padded, so the coordinator takes the staged path) and a bias.
struct model {
  index_t ld;
  dtype type;
  std::vector<std::byte> weight;
  std::vector<float> grad;
  std::vector<float> bias = std::vector<float>(8, 0.0f), bias_grad = std::vector<float>(8, 0.0f);

  model(index_t ld_, dtype type_)
      : ld(ld_),
        type(type_),
        weight(static_cast<std::size_t>(ld_ * cols) * dtype_size(type_), std::byte{padding_byte}),
        grad(static_cast<std::size_t>(ld_ * cols), 0.0f) {}
  matrix_view view() { return {weight.data(), rows, cols, 1, ld, type, memory_space::host}; }
  const_matrix_view grad_view() const { return {grad.data(), rows, cols, 1, ld, dtype::f32, memory_space::host}; }
  float at(index_t r, index_t c) const {
    float out = 0.0f;
    dispatch_dtype(type, [&](auto tag) {
      using T = decltype(tag);
      out = to_float(reinterpret_cast<const T*>(weight.data())[r + c * ld]);
    });
    return out;
  }
  // A gradient that follows the weights (so every update feeds the next), with columns of
  // different sizes and, at the poisoned step, one NaN.
  void make_gradients(std::int64_t step) {
    for (index_t c = 0; c < cols; ++c)
      for (index_t r = 0; r < rows; ++r) {
        const float noise = 0.01f * std::sin(static_cast<float>(step * 131 + r * 7 + c * 13));
        grad[r + c * ld] = (c % 6 == 0 ? 4.0f : 0.5f) * (at(r, c) - 0.01f * static_cast<float>(r - c)) + noise;
      }
    for (std::size_t i = 0; i < bias.size(); ++i) bias_grad[i] = bias[i] - 0.1f * static_cast<float>(i);
    if (step == poisoned_step) grad[3 + 5 * ld] = std::nanf("");
  }
  // The weight's values (and the bias), as bits, in column order.
  std::vector<std::uint32_t> values() const {
    std::vector<std::uint32_t> out;
    for (index_t c = 0; c < cols; ++c)
      for (index_t r = 0; r < rows; ++r) {
        const float x = at(r, c);
        std::uint32_t bits;
        std::memcpy(&bits, &x, 4);
        out.push_back(bits);
      }
    for (const float b : bias) {
      std::uint32_t bits;
      std::memcpy(&bits, &b, 4);
      out.push_back(bits);
    }
    return out;
  }
  // Whether every element between the padded layout's columns still holds the fill.
  bool padding_intact() const {
    const std::size_t esize = dtype_size(type);
    for (index_t c = 0; c < cols; ++c)
      for (std::size_t b = static_cast<std::size_t>(rows + c * ld) * esize;
           b < static_cast<std::size_t>((c + 1) * ld) * esize; ++b)
        if (weight[b] != std::byte{padding_byte}) return false;
    return true;
  }
};

struct run_result {
  std::vector<std::vector<std::uint32_t>> after_step;  // the values after each step
  bool padding_intact = true;
  bool gradients_intact = true;
  host_memory_bytes memory_at_first_step, memory_at_end;
};

// Trains `steps` steps; at step `padded_grad_step` the weight's gradient is handed over in a padded
// copy (a layout the in-place update cannot read).
run_result train(const zenflow_options& options, const coordinator_config& config, index_t ld, dtype type,
                 std::int64_t padded_grad_step = -1) {
  model m(ld, type);
  std::vector<float> initial(static_cast<std::size_t>(rows * cols));
  for (index_t c = 0; c < cols; ++c)
    for (index_t r = 0; r < rows; ++r) initial[r + c * rows] = 0.05f * std::cos(static_cast<float>(r * 3 + c));
  const matrix_view w = m.view();
  for (index_t c = 0; c < cols; ++c)
    for (index_t r = 0; r < rows; ++r)
      dispatch_dtype(type, [&](auto tag) {
        using T = decltype(tag);
        static_cast<T*>(w.data)[w.offset(r, c)] = from_float<T>(initial[r + c * rows]);
      });
  {
    host_coordinator coordinator(options, config);
    coordinator.register_parameter(
        "w", m.view(), const_matrix_view::column_contiguous(initial.data(), rows, cols, dtype::f32), dtype::f32);
    coordinator.register_parameter("b", vector_view{m.bias.data(), static_cast<index_t>(m.bias.size()), dtype::f32},
                                   std::vector<float>(m.bias.size(), 0.0f));
    host_stream stream;
    run_result out;
    for (std::int64_t s = 0; s < steps; ++s) {
      m.make_gradients(s);
      const std::vector<float> grad_before = m.grad;
      std::vector<float> padded(static_cast<std::size_t>((rows + 5) * cols), 0.0f);
      if (s == padded_grad_step) {
        for (index_t c = 0; c < cols; ++c)
          for (index_t r = 0; r < rows; ++r) padded[r + c * (rows + 5)] = m.grad[r + c * ld];
        coordinator.submit_gradient(0, {padded.data(), rows, cols, 1, rows + 5, dtype::f32, memory_space::host},
                                    &stream);
      } else {
        coordinator.submit_gradient(0, m.grad_view(), &stream);
      }
      coordinator.submit_gradient(1, const_vector_view{m.bias_grad.data(), 8, dtype::f32}, &stream);
      coordinator.step(&stream);
      stream.synchronize();
      if (s == 0) out.memory_at_first_step = coordinator.host_memory();
      out.after_step.push_back(m.values());
      out.gradients_intact = out.gradients_intact &&
                             std::memcmp(grad_before.data(), m.grad.data(), grad_before.size() * sizeof(float)) == 0;
    }
    coordinator.finish(&stream);
    out.memory_at_end = coordinator.host_memory();
    out.after_step.push_back(m.values());
    out.padding_intact = m.padding_intact();
    return out;
  }
}

zenflow_options clipped(zenflow_options o) {
  o.optimizer.lr = 0.02f;
  o.optimizer.weight_decay = 0.01f;
  o.max_grad_norm = 0.5f;  // every step is clipped: the in-place update must apply the step's scale
  return o;
}

}  // namespace

TEST_CASE("in-place CPU updates give the staged path's results bit for bit") {
  zenflow_options zero = clipped(zenflow_options::zero_offload());
  zenflow_options sync = clipped({});  // ZenFlow without overlap, one-step intervals: every step
  sync.topk_ratio = 0.25f;
  sync.full_warm_up_rounds = 2;
  sync.select_interval = interval_option::fixed(3);
  sync.update_interval = interval_option::fixed(1);
  sync.overlap_step = false;
  zenflow_options async = sync;  // in place only in its warm-up
  async.update_interval = interval_option::fixed(2);
  async.overlap_step = true;
  coordinator_config config;
  config.cpu_threads = 2;
  coordinator_config bf16_state = config;
  bf16_state.cpu_state = cpu_state_format::bf16_moments;

  struct variant {
    const char* name;
    zenflow_options options;
    coordinator_config config;
    dtype type;
  };
  const variant variants[] = {
      {"zero_offload f32", zero, config, dtype::f32},
      {"zero_offload bf16", zero, config, dtype::bf16},
      {"zero_offload bf16 moments", zero, bf16_state, dtype::f32},
      {"zenflow sync f32", sync, config, dtype::f32},
      {"zenflow sync bf16", sync, config, dtype::bf16},
      {"zenflow async f32", async, config, dtype::f32},
  };
  for (const variant& v : variants) {
    CAPTURE(v.name);
    const run_result in_place = train(v.options, v.config, rows, v.type);
    const run_result staged = train(v.options, v.config, rows + 3, v.type);
    REQUIRE(in_place.after_step.size() == staged.after_step.size());
    for (std::size_t s = 0; s < in_place.after_step.size(); ++s) {
      CAPTURE(s);
      CHECK(in_place.after_step[s] == staged.after_step[s]);
    }
    CHECK(in_place.after_step.front() != in_place.after_step.back());  // it trained
    // The skipped step changed nothing.
    CHECK(in_place.after_step[poisoned_step] == in_place.after_step[poisoned_step - 1]);
    CHECK(staged.padding_intact);
    CHECK(in_place.gradients_intact);
    CHECK(staged.gradients_intact);
  }
}

TEST_CASE("ZeRO-Offload in place holds no accumulator or write-back staging until a step needs them") {
  const zenflow_options zero = clipped(zenflow_options::zero_offload());
  coordinator_config config;
  config.cpu_threads = 2;
  const std::size_t elements = static_cast<std::size_t>(rows * cols);
  for (const dtype type : {dtype::f32, dtype::bf16}) {
    CAPTURE(std::string(dtype_name(type)));
    const run_result in_place = train(zero, config, rows, type);
    CHECK(in_place.memory_at_end.accumulators == 0);
    CHECK(in_place.memory_at_end.device_buffers == 0);
    const run_result staged = train(zero, config, rows + 3, type);
    CHECK(staged.memory_at_first_step.accumulators == elements * sizeof(float));
    CHECK(staged.memory_at_first_step.device_buffers == elements * dtype_size(type));
    // One step's gradient in a padded copy: that step goes the staged way, with its buffers
    // allocated then, and the results stay the staged path's.
    const run_result mixed = train(zero, config, rows, type, /*padded_grad_step=*/2);
    CHECK(mixed.memory_at_first_step.accumulators == 0);
    CHECK(mixed.memory_at_end.accumulators == elements * sizeof(float));
    CHECK(mixed.memory_at_end.device_buffers == elements * dtype_size(type));
    REQUIRE(mixed.after_step.size() == staged.after_step.size());
    for (std::size_t s = 0; s < mixed.after_step.size(); ++s) {
      CAPTURE(s);
      CHECK(mixed.after_step[s] == staged.after_step[s]);
    }
  }
}

}  // namespace ZENFLOW_TEST_FILE_ID
