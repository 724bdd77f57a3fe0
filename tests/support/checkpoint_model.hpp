// A small model trained by a host_coordinator, and the configurations whose checkpoints the
// checkpoint tests and the checkpoint fuzzer start from (tests/unit/test_checkpoint.cpp,
// tests/fuzz/). Everything is deterministic: the same configuration gives the same file.
//
// Model: a bf16 row-major weight (6 x 10), an f32 column-contiguous weight (5 x 8), an f32 bias
// (4). Gradients: scale_c * (w - target) + a fixed per-step perturbation, so column norms differ
// and the selection matters.
#pragma once

#include <zenflow/coordinator.hpp>

#include "exported_state.hpp"
#include "storage_test_utils.hpp"

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace zenflow::testing {

/// A named coordinator configuration and how many steps to train before saving.
struct checkpoint_configuration {
  const char* name;
  zenflow_options options;
  std::int64_t steps;
  /// Train with missing_gradients::skip: some parameters get no gradient in some steps.
  bool missing_gradients = false;
  /// How the CPU optimizer holds the moments (coordinator_config::cpu_state).
  cpu_state_format cpu_state = cpu_state_format::fp32;
  /// The CPU columns' moments in a state file on disk (coordinator_config::nvme).
  bool nvme = false;
};

inline zenflow_options checkpoint_base_options() {
  zenflow_options o;
  o.optimizer.lr = 0.01f;
  o.optimizer.weight_decay = 0.01f;
  o.topk_ratio = 0.25f;
  o.select_interval = interval_option::fixed(4);
  o.update_interval = interval_option::fixed(3);
  return o;
}

/// The states a checkpoint can capture: before the first step, in warm-up, mid-interval with an
/// asynchronous CPU result pending, after a reselection, with "auto" intervals, dense (the
/// selector's k smaller than every column) and ZeRO-Offload.
inline std::vector<checkpoint_configuration> checkpoint_configurations() {
  std::vector<checkpoint_configuration> out;
  out.push_back({"before_first_step", checkpoint_base_options(), 0});
  auto warm = checkpoint_base_options();
  warm.full_warm_up_rounds = 3;
  out.push_back({"warm_up", warm, 2});
  out.push_back({"pending", checkpoint_base_options(), 4});  // interval 0 pending, interval 1 begun
  auto reselect = checkpoint_base_options();
  reselect.update_interval = interval_option::fixed(2);
  reselect.select_interval = interval_option::fixed(3);
  out.push_back({"after_reselection", reselect, 7});
  auto automatic = checkpoint_base_options();
  automatic.update_interval = interval_option::automatic();
  automatic.max_update_interval = 3;
  out.push_back({"auto_interval", automatic, 6});
  auto dense = zenflow_options::dense();
  dense.topk_ratio = 0.5f;
  out.push_back({"dense", dense, 3});
  out.push_back({"zero_offload", zenflow_options::zero_offload(), 3});
  // Mid-interval, a CPU result pending, per-parameter counts that differ (see checkpoint_model::train).
  out.push_back({"missing_gradients", checkpoint_base_options(), 5, true});
  // Compact CPU moments: the state leaves and enters the CPU optimizer through its fp32 export
  // and import (reselections, the checkpoint), which must leave it unchanged.
  out.push_back({"after_reselection_bf16_moments", reselect, 7, false, cpu_state_format::bf16_moments});
  out.push_back(
      {"pending_blockwise8_moments", checkpoint_base_options(), 4, false, cpu_state_format::blockwise8_moments});
  // Moments on disk: the checkpoint streams them from the state file and back.
  out.push_back({"after_reselection_nvme", reselect, 7, false, cpu_state_format::fp32, true});
  return out;
}

/// The bytes of `vectors`, one after the other (a model's weights: its snapshot).
template <class... Vectors>
std::vector<std::byte> bytes_of(const Vectors&... vectors) {
  std::vector<std::byte> all;
  auto append = [&all](const auto& v) {
    const auto* p = reinterpret_cast<const std::byte*>(v.data());
    all.insert(all.end(), p, p + v.size() * sizeof(v[0]));
  };
  (append(vectors), ...);
  return all;
}
/// Sets `vectors` (sized already) to `bytes`, as bytes_of wrote them.
template <class... Vectors>
void set_bytes(const std::vector<std::byte>& bytes, Vectors&... vectors) {
  std::size_t at = 0;
  auto take = [&](auto& v) {
    std::memcpy(v.data(), bytes.data() + at, v.size() * sizeof(v[0]));
    at += v.size() * sizeof(v[0]);
  };
  (take(vectors), ...);
}

/// The model, its stream and a host_coordinator with the model's parameters registered.
class checkpoint_model {
 public:
  static constexpr index_t rows0 = 6, cols0 = 10, rows1 = 5, cols1 = 8, bias_size = 4;

  explicit checkpoint_model(const zenflow_options& options, std::size_t cpu_threads = 1, bool missing_gradients = false,
                            cpu_state_format cpu_state = cpu_state_format::fp32, bool nvme = false)
      : missing_(missing_gradients),
        dir_(nvme ? std::make_unique<zenflow_test::scratch_dir>() : nullptr),
        coordinator_(options, config(cpu_threads, cpu_state, dir_.get())) {
    w0_.resize(rows0 * cols0);
    g0_.resize(rows0 * cols0);
    w1_.resize(rows1 * cols1);
    g1_.resize(rows1 * cols1);
    bias_.resize(bias_size);
    bias_grad_.resize(bias_size);
    std::vector<float> initial0(w0_.size()), initial1(w1_.size());
    for (std::size_t i = 0; i < initial0.size(); ++i) {
      initial0[i] = 0.01f * static_cast<float>(static_cast<int>(i % 13) - 6);
      w0_[i] = from_float<bfloat16>(initial0[i]);
    }
    for (std::size_t i = 0; i < initial1.size(); ++i) w1_[i] = initial1[i] = 0.02f * static_cast<float>(i % 7);
    coordinator_.register_parameter("w0", matrix_view::row_major(w0_.data(), rows0, cols0, dtype::bf16),
                                    const_matrix_view::row_major(initial0.data(), rows0, cols0, dtype::f32),
                                    dtype::bf16);
    coordinator_.register_parameter("w1", matrix_view::column_contiguous(w1_.data(), rows1, cols1, dtype::f32),
                                    const_matrix_view::column_contiguous(initial1.data(), rows1, cols1, dtype::f32),
                                    dtype::f32);
    const std::vector<float> bias0(bias_size, 0.0f);
    coordinator_.register_parameter("bias", vector_view{bias_.data(), bias_size, dtype::f32}, bias0);
  }

  /// The model of a configuration (its options, and whether it trains with missing gradients).
  explicit checkpoint_model(const checkpoint_configuration& c, std::size_t cpu_threads = 1)
      : checkpoint_model(c.options, cpu_threads, c.missing_gradients, c.cpu_state, c.nvme) {}

  host_coordinator& coordinator() noexcept { return coordinator_; }
  host_stream& stream() noexcept { return stream_; }

  /// Runs `steps` training steps (each: gradients from the current weights, submit, step). With
  /// missing gradients (by the step's number, so that a resumed run continues the pattern): w0 has
  /// none in steps 1, 2 mod 6 (a whole interval of 3 may miss it), w1 none in odd steps, the bias
  /// none in steps 2 mod 4.
  void train(std::int64_t steps) {
    for (std::int64_t s = 0; s < steps; ++s) {
      stream_.synchronize();  // the "backward" reads the weights after the previous step's updates
      const std::int64_t step = coordinator_.step_count();
      make_gradients(step);
      const bool skip0 = missing_ && (step % 6 == 1 || step % 6 == 2);
      const bool skip1 = missing_ && step % 2 == 1;
      const bool skip2 = missing_ && step % 4 == 2;
      if (!skip0)
        coordinator_.submit_gradient(0, const_matrix_view::row_major(g0_.data(), rows0, cols0, dtype::bf16), &stream_);
      if (!skip1)
        coordinator_.submit_gradient(1, const_matrix_view::column_contiguous(g1_.data(), rows1, cols1, dtype::f32),
                                     &stream_);
      if (!skip2)
        coordinator_.submit_gradient(2, const_vector_view{bias_grad_.data(), bias_size, dtype::f32}, &stream_);
      coordinator_.step(&stream_, missing_ ? missing_gradients::skip : missing_gradients::reject);
    }
    stream_.synchronize();
  }

  /// The model's parameter bytes (synchronizes the stream first).
  std::vector<std::byte> snapshot() {
    stream_.synchronize();
    return bytes_of(w0_, w1_, bias_);
  }

  /// Sets the model's parameters to `bytes` (a snapshot()): what a trainer restores itself before
  /// loading a checkpoint of checkpoint_contents::optimizer_state.
  void restore(const std::vector<std::byte>& bytes) {
    stream_.synchronize();
    set_bytes(bytes, w0_, w1_, bias_);
  }

  /// The CPU optimizer's fp32 master and moments of both weights (the moments as it exports them
  /// in fp32, whatever it holds).
  std::vector<float> cpu_state() const {
    std::vector<float> all;
    const auto& opt = coordinator_.host_optimizer();
    for (std::size_t t = 0; t < 2; ++t) {
      const auto s = zenflow_test::export_state(opt, t);
      for (const auto* part : {&s.master, &s.exp_avg, &s.exp_avg_sq}) all.insert(all.end(), part->begin(), part->end());
    }
    return all;
  }

 private:
  static coordinator_config config(std::size_t cpu_threads, cpu_state_format cpu_state,
                                   const zenflow_test::scratch_dir* nvme_dir) {
    coordinator_config c;
    c.cpu_threads = cpu_threads;
    c.cpu_state = cpu_state;
    if (nvme_dir != nullptr) {
      nvme_state_config n;
      n.file.directory = nvme_dir->path();
      n.file.block_bytes = 4096;  // 512 elements: each weight's state spans one block
      n.file.read_ahead = n.file.write_behind = 1;
      n.file.pin = pin_policy::none;
      n.engine = {io_engine_kind::automatic, 4};
      c.nvme = n;
    }
    c.d2h_slot_bytes = 64;  // small slots: gradients are split and pipelined
    c.d2h_slots = 2;
    c.h2d_slot_bytes = 64;
    c.record_trace = true;
    return c;
  }
  void make_gradients(std::int64_t step) {
    const float wobble = 0.03f * static_cast<float>(step % 5);
    for (index_t r = 0; r < rows0; ++r)
      for (index_t c = 0; c < cols0; ++c) {
        const float w = to_float(w0_[r * cols0 + c]);
        const float scale = (c % 3 == 0) ? 4.0f : 0.5f + 0.1f * static_cast<float>(c);
        g0_[r * cols0 + c] = from_float<bfloat16>(scale * (w - 0.1f) + wobble * static_cast<float>((r + c) % 3));
      }
    for (index_t c = 0; c < cols1; ++c)
      for (index_t r = 0; r < rows1; ++r) {
        const float scale = (c % 4 == 1) ? 3.0f : 0.25f * static_cast<float>(c + 1);
        g1_[c * rows1 + r] = scale * (w1_[c * rows1 + r] + 0.2f) - wobble;
      }
    for (index_t i = 0; i < bias_size; ++i) bias_grad_[i] = bias_[i] - 0.5f + wobble;
  }

  std::vector<bfloat16> w0_, g0_;
  std::vector<float> w1_, g1_, bias_, bias_grad_;
  bool missing_ = false;
  std::unique_ptr<zenflow_test::scratch_dir> dir_;  // the state file's, with nvme
  host_stream stream_;
  host_coordinator coordinator_;
};

/// The bytes of a file.
inline std::vector<char> read_file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}
inline void write_file_bytes(const std::string& path, const std::vector<char>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

/// Sets a checkpoint's header (payload size and checksum, of the header's format version) to match
/// its payload, so that a modified field reaches the loader's validation instead of failing the
/// checksum.
inline void reseal_checkpoint(std::vector<char>& bytes) {
  if (bytes.size() < detail::checkpoint_header_bytes) return;
  const std::uint64_t size = bytes.size() - detail::checkpoint_header_bytes;
  const auto* payload = reinterpret_cast<const std::byte*>(bytes.data()) + detail::checkpoint_header_bytes;
  std::uint32_t version = 0;
  std::memcpy(&version, bytes.data() + 8, sizeof version);
  detail::checkpoint_checksum checksum(version);
  checksum.update({payload, size});
  const std::uint64_t hash = checksum.value();
  std::memcpy(bytes.data() + 16, &size, sizeof size);
  std::memcpy(bytes.data() + 24, &hash, sizeof hash);
}

/// A checkpoint's payload as named fields, in file order, that a test can change and write back
/// (with a matching header). Scalars keep their raw bytes; arrays their elements' raw bytes.
/// Names: "options" (the schedule's), "optimizer" (its name), "optimizer_fields" (its field table as
/// text), "optimizer_slots" (its state slots' names), "shared_hyper_parameters", "contents", "rank", "ranks", "step",
/// "started", "interval", "first_step", "steps", "target", "pending", "overlap", "host_steps", "device_steps",
/// "current_count", "pending_count", "parameters", then per parameter "<name>.<field>" with the fields of
/// checkpoint_io.hpp (host_steps, device_steps, current_count, pending_count, master, cpu_p, cpu_m, cpu_v, selection,
/// compact, accumulator, pending, values; a 1-D parameter: device_steps, master, state, values).
class checkpoint_document {
 public:
  struct field {
    std::string name;
    std::vector<char> bytes;
    std::size_t element = 0;  // 0: a scalar; else the element size of an array
    std::size_t offset = 0;   // of its first byte in the file it was read from
  };

  explicit checkpoint_document(const std::vector<char>& file) {
    std::size_t pos = detail::checkpoint_header_bytes;
    auto scalar = [&](std::string name, std::size_t size) {
      if (pos + size > file.size()) throw std::runtime_error("checkpoint_document: file ends early");
      fields_.push_back({std::move(name), {file.begin() + pos, file.begin() + pos + size}, 0, pos});
      pos += size;
      return fields_.back().bytes;
    };
    auto array = [&](std::string name, std::size_t element) {
      std::uint64_t n = 0;
      const auto count = scalar("", 8);
      fields_.pop_back();
      std::memcpy(&n, count.data(), 8);
      if (n > (file.size() - pos) / element) throw std::runtime_error("checkpoint_document: bad array length");
      fields_.push_back({std::move(name), {file.begin() + pos, file.begin() + pos + n * element}, element, pos});
      pos += n * element;
      return fields_.back().bytes;
    };
    scalar("options", 40);
    array("optimizer", 1);
    array("optimizer_fields", 1);
    array("optimizer_slots", 1);
    scalar("shared_hyper_parameters", 2);  // Adam's adamw_mode, bias_correction
    scalar("contents", 1);
    scalar("rank", 4);
    scalar("ranks", 4);
    for (const char* name :
         {"step", "started", "interval", "first_step", "steps", "target", "pending", "overlap", "selection_due",
          "host_steps", "device_steps", "current_count", "pending_count", "parameters"})
      scalar(name, std::string(name) == "started" || std::string(name) == "selection_due" ? 1 : 8);
    std::uint64_t parameters = 0;
    std::memcpy(&parameters, fields_.back().bytes.data(), 8);
    for (std::uint64_t i = 0; i < parameters; ++i) {
      const auto name_chars = array("name", 1);
      const std::string name(name_chars.begin(), name_chars.end());
      fields_.back().name = name + ".name";
      const bool is_vector = scalar(name + ".is_vector", 1)[0] != 0;
      for (const char* f : {"lr", "beta1", "beta2", "eps", "weight_decay"}) scalar(name + "." + f, 4);  // per group
      if (is_vector) {
        scalar(name + ".size", 8);
        scalar(name + ".type", 1);
        scalar(name + ".device_steps", 8);
        scalar(name + ".master", 1);
        array(name + ".state", 4);
        array(name + ".values", 1);
        continue;
      }
      for (const char* f : {"rows", "cols"}) scalar(name + "." + f, 8);
      for (const char* f : {"type", "grad_type"}) scalar(name + "." + f, 1);
      for (const char* f : {"host_steps", "device_steps", "current_count", "pending_count"}) scalar(name + "." + f, 8);
      scalar(name + ".master", 1);
      for (const char* f : {"cpu_p", "cpu_m", "cpu_v", "selection", "compact", "accumulator"}) array(name + "." + f, 4);
      for (const char* f : {"pending", "values"}) array(name + "." + f, 1);
    }
    if (pos != file.size()) throw std::runtime_error("checkpoint_document: trailing bytes");
  }

  /// Every field, in file order.
  [[nodiscard]] const std::vector<field>& fields() const noexcept { return fields_; }
  field& operator[](const std::string& name) {
    for (auto& f : fields_)
      if (f.name == name) return f;
    throw std::runtime_error("checkpoint_document: no field " + name);
  }
  template <class T>
  T get(const std::string& name) {
    T value;
    std::memcpy(&value, (*this)[name].bytes.data(), sizeof(T));
    return value;
  }
  template <class T>
  void set(const std::string& name, T value) {
    auto& f = (*this)[name];
    f.bytes.resize(sizeof(T));
    std::memcpy(f.bytes.data(), &value, sizeof(T));
  }
  /// Removes (n < 0) or appends zero (n > 0) elements of an array field.
  void resize_by(const std::string& name, std::ptrdiff_t n) {
    auto& f = (*this)[name];
    f.bytes.resize(f.bytes.size() + n * static_cast<std::ptrdiff_t>(f.element));
  }

  /// The whole file, header included (size and hash match the payload).
  [[nodiscard]] std::vector<char> file() const {
    std::vector<char> out(detail::checkpoint_header_bytes);
    std::memcpy(out.data(), detail::checkpoint_magic, 8);
    const std::uint32_t version = detail::checkpoint_version;
    std::memcpy(out.data() + 8, &version, 4);
    for (const auto& f : fields_) {
      if (f.element != 0) {
        const std::uint64_t n = f.bytes.size() / f.element;
        const auto* p = reinterpret_cast<const char*>(&n);
        out.insert(out.end(), p, p + 8);
      }
      out.insert(out.end(), f.bytes.begin(), f.bytes.end());
    }
    reseal_checkpoint(out);
    return out;
  }

 private:
  std::vector<field> fields_;
};

}  // namespace zenflow::testing
