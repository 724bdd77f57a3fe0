// Checkpoints of the host coordinator (tests/support/checkpoint_model.hpp):
//   - every state a checkpoint can capture (before the first step, warm-up, an asynchronous
//     result pending, after a reselection, auto intervals, dense, ZeRO-Offload) loads, saves
//     back to the same bytes and resumes bit-identically;
//   - saving with no parameters frees no buffer a copy still writes (run under TSan);
//   - a directory, a device or a missing file is rejected with zenflow::error;
//   - the header's checksum is the payload's CRC32C; format 7 files (FNV-1a) still load; a flipped
//     payload bit or another version is refused;
//   - the writer streams arrays larger than its buffer, and unaligned ones, intact, and puts
//     arrays side by side (parts interleaved) into the file put one by one would give;
//   - a save adds a run of a parameter's state to the resident set, not the parameter's whole state;
//   - a failed save (write or rename) leaves no "<path>.tmp" and the old checkpoint untouched;
//   - crafted files with a valid checksum (one field changed, header resealed) are rejected
//     before anything changes, and the coordinator still loads the real file afterwards.
#include "../support/checkpoint_model.hpp"
#include "../support/coordinator_instances.hpp"

#include <doctest/doctest.h>
#include <sys/resource.h>
#include <unistd.h>
#include <zenflow/crc32c.hpp>

#include <cmath>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "../support/test_file_id.hpp"

namespace ZENFLOW_TEST_FILE_ID {  // this file's names (tests/support/test_file_id.hpp)

using namespace zenflow;
using namespace zenflow::testing;

namespace {

std::string temp_path(const std::string& name) {
  const auto file = "zenflow_test_checkpoint_" + std::to_string(::getpid()) + "_" + name;
  return (std::filesystem::temp_directory_path() / file).string();
}

// Element i of a float array field's bytes.
void set_float(std::vector<char>& bytes, std::size_t i, float x) {
  REQUIRE(bytes.size() >= (i + 1) * sizeof(float));
  std::memcpy(bytes.data() + i * sizeof(float), &x, sizeof(float));
}

// A string field's bytes (an array of chars).
void set_text(std::vector<char>& bytes, const std::string& text) {
  bytes.assign(text.begin(), text.end());
}

// Index of row `row` of selected column `column`'s first (which 0) or second (1) moment in
// parameter `name`'s compact GPU state ([master,] m, v per selected column).
std::size_t compact_moment(checkpoint_document& d, const std::string& name, std::size_t column, std::size_t which,
                           std::size_t row) {
  const auto rows = static_cast<std::size_t>(d.get<std::int64_t>(name + ".rows"));
  const std::size_t master = d.get<std::uint8_t>(name + ".master") != 0 ? 1 : 0;
  return column * (master + 2) * rows + (master + which) * rows + row;
}

const checkpoint_configuration& configuration(const std::string& name) {
  static const auto all = checkpoint_configurations();
  for (const auto& c : all)
    if (c.name == name) return c;
  throw std::runtime_error("no configuration " + name);
}

// The checkpoint of `c` after its steps.
std::vector<char> saved_checkpoint(const checkpoint_configuration& c,
                                   checkpoint_contents contents = checkpoint_contents::everything) {
  const auto path = temp_path(std::string(c.name) + ".bin");
  checkpoint_model m(c);
  m.train(c.steps);
  m.coordinator().save_checkpoint(path, &m.stream(), contents);
  auto bytes = read_file_bytes(path);
  std::filesystem::remove(path);
  return bytes;
}

// The weights after `c.steps + more` uninterrupted steps and finish().
std::vector<std::byte> uninterrupted(const checkpoint_configuration& c, std::int64_t more) {
  checkpoint_model m(c);
  m.train(c.steps + more);
  m.coordinator().finish(&m.stream());
  return m.snapshot();
}

// Loads `file` into `m`, trains `more` steps, finishes; returns the weights.
std::vector<std::byte> resume(checkpoint_model& m, const std::vector<char>& file, std::int64_t more) {
  const auto path = temp_path("resume.bin");
  write_file_bytes(path, file);
  m.coordinator().load_checkpoint(path, &m.stream());
  std::filesystem::remove(path);
  m.train(more);
  m.coordinator().finish(&m.stream());
  return m.snapshot();
}

// A coordinator that never loaded anything: no step, no GPU columns, registered values.
void check_untouched(checkpoint_model& m, const std::vector<std::byte>& weights, const std::vector<float>& cpu) {
  CHECK(m.coordinator().step_count() == 0);
  CHECK(m.coordinator().gpu_columns(0).empty());
  CHECK(m.coordinator().gpu_columns(1).empty());
  CHECK(m.coordinator().host_optimizer().step_count() == 0);
  CHECK(m.coordinator().device_optimizer().step_count() == 0);
  CHECK(m.snapshot() == weights);
  CHECK(m.cpu_state() == cpu);
}

// `file` is rejected with zenflow::error naming `reason`, nothing changes, and the same
// coordinator then loads the real checkpoint of `c` and resumes exactly like an uninterrupted run.
void check_rejected(const checkpoint_configuration& c, const std::vector<char>& file, const char* reason) {
  checkpoint_model m(c);
  const auto weights = m.snapshot();
  const auto cpu = m.cpu_state();
  const auto path = temp_path("crafted.bin");
  write_file_bytes(path, file);
  CHECK_THROWS_WITH_AS(m.coordinator().load_checkpoint(path, &m.stream()), doctest::Contains(reason), zenflow::error);
  std::filesystem::remove(path);
  check_untouched(m, weights, cpu);
  std::vector<std::byte> resumed;
  CHECK_NOTHROW(resumed = resume(m, saved_checkpoint(c), 3));
  CHECK(resumed == uninterrupted(c, 3));
}

// The optimizer state of a coordinator on which `make` registered the parameters (before the first
// step), saved to `path` and read back.
checkpoint_document saved_optimizer_state(const std::string& path, const std::function<void(host_coordinator&)>& make) {
  host_stream stream;
  host_coordinator c(checkpoint_base_options());
  make(c);
  c.save_checkpoint(path, &stream, checkpoint_contents::optimizer_state);
  return checkpoint_document(read_file_bytes(path));
}
}  // namespace

TEST_CASE("every checkpointable state loads, saves back identically and resumes bit-identically") {
  for (const auto& c : checkpoint_configurations()) {
    INFO("configuration " << std::string(c.name));
    const auto file = saved_checkpoint(c);
    checkpoint_model original(c);
    original.train(c.steps);
    CHECK(original.coordinator().host_optimizer().state_format() == c.cpu_state);
    checkpoint_model loaded(c);
    const auto path = temp_path("roundtrip.bin");
    write_file_bytes(path, file);
    REQUIRE_NOTHROW(loaded.coordinator().load_checkpoint(path, &loaded.stream()));
    CHECK(loaded.coordinator().step_count() == c.steps);
    CHECK(loaded.snapshot() == original.snapshot());
    loaded.coordinator().save_checkpoint(path, &loaded.stream());
    CHECK(read_file_bytes(path) == file);  // nothing of the state was lost or invented
    std::filesystem::remove(path);
    loaded.train(4);
    loaded.coordinator().finish(&loaded.stream());
    CHECK(loaded.snapshot() == uninterrupted(c, 4));
  }
}

TEST_CASE("the optimizer state alone (the trainer restores its parameters) resumes bit-identically") {
  for (const auto& c : checkpoint_configurations()) {
    INFO("configuration " << std::string(c.name));
    const auto file = saved_checkpoint(c, checkpoint_contents::optimizer_state);
    checkpoint_model original(c);
    original.train(c.steps);
    checkpoint_model loaded(c);
    loaded.restore(original.snapshot());  // as model.load_state_dict() does before the optimizer's
    const auto path = temp_path("state.bin");
    write_file_bytes(path, file);
    REQUIRE_NOTHROW(loaded.coordinator().load_checkpoint(path, &loaded.stream()));
    CHECK(loaded.snapshot() == original.snapshot());  // the parameters are the trainer's: untouched
    loaded.coordinator().save_checkpoint(path, &loaded.stream(), checkpoint_contents::optimizer_state);
    CHECK(read_file_bytes(path) == file);
    std::filesystem::remove(path);
    loaded.train(4);
    loaded.coordinator().finish(&loaded.stream());
    CHECK(loaded.snapshot() == uninterrupted(c, 4));
    // Each column's state once, the fp32 master only where it is not the parameter's values (the
    // bf16 w0's), no parameter values.
    checkpoint_document d(file);
    CHECK(d.get<std::uint8_t>("contents") == 1);
    CHECK(d.get<std::uint8_t>("w0.master") == 1);
    CHECK(d.get<std::uint8_t>("w1.master") == 0);
    CHECK(d.get<std::uint8_t>("bias.master") == 0);
    CHECK(d["w1.cpu_p"].bytes.empty());
    CHECK(d["w0.values"].bytes.empty());
    CHECK(d["bias.state"].bytes.size() == 2 * checkpoint_model::bias_size * sizeof(float));
    const std::size_t k1 = d["w1.selection"].bytes.size() / sizeof(std::int32_t);
    const std::size_t rows1 = checkpoint_model::rows1, cols1 = checkpoint_model::cols1;
    CHECK(d["w1.compact"].bytes.size() == 2 * k1 * rows1 * sizeof(float));
    CHECK(d["w1.cpu_m"].bytes.size() == (cols1 - k1) * rows1 * sizeof(float));
    CHECK(file.size() < saved_checkpoint(c).size());
  }
}

TEST_CASE("an f32 master that is not the parameter's values is written with the optimizer state") {
  // Registered with an fp32 master of its own (the trainer keeps one), before the first step.
  std::vector<float> w(4 * 6), master(w.size());
  for (std::size_t i = 0; i < w.size(); ++i) {
    master[i] = 0.001f * static_cast<float>(i) + 1e-7f;
    w[i] = 0.001f * static_cast<float>(i);
  }
  auto make = [&](host_coordinator& c) {
    c.register_parameter("w", matrix_view::row_major(w.data(), 4, 6, dtype::f32),
                         const_matrix_view::row_major(master.data(), 4, 6, dtype::f32), dtype::f32);
  };
  const auto path = temp_path("own_master.bin");
  checkpoint_document d = saved_optimizer_state(path, make);
  CHECK(d.get<std::uint8_t>("w.master") == 1);
  master.assign(master.size(), 0.0f);  // another master: the file's must win
  host_stream stream;
  host_coordinator c(checkpoint_base_options());
  make(c);
  c.load_checkpoint(path, &stream);
  std::filesystem::remove(path);
  const auto loaded = c.host_optimizer().params(0);
  for (index_t col = 0; col < 6; ++col)
    for (index_t r = 0; r < 4; ++r) CHECK(loaded[col * 4 + r] == 0.001f * static_cast<float>(r * 6 + col) + 1e-7f);
}

TEST_CASE("a bf16 master equal to its values (an adopted edit) is written and loads") {
  // A bf16 parameter whose fp32 master holds exactly its values, as after reload_parameter: the
  // optimizer state still carries the master (the load takes one from f32 values only).
  std::vector<bfloat16> w(4 * 6), b(5);
  std::vector<float> master(w.size()), b_master(b.size());
  for (std::size_t i = 0; i < w.size(); ++i) {
    w[i] = to_bfloat16(0.01f * static_cast<float>(i) - 0.1f);
    master[i] = to_float(w[i]);
  }
  for (std::size_t i = 0; i < b.size(); ++i) {
    b[i] = to_bfloat16(0.5f - 0.125f * static_cast<float>(i));
    b_master[i] = to_float(b[i]);
  }
  auto make = [&](host_coordinator& c) {
    c.register_parameter("w", matrix_view::row_major(w.data(), 4, 6, dtype::bf16),
                         const_matrix_view::row_major(master.data(), 4, 6, dtype::f32), dtype::bf16);
    c.register_parameter("b", vector_view{b.data(), 5, dtype::bf16}, b_master);
  };
  const auto path = temp_path("bf16_master.bin");
  checkpoint_document d = saved_optimizer_state(path, make);
  CHECK(d.get<std::uint8_t>("w.master") == 1);
  CHECK(d.get<std::uint8_t>("b.master") == 1);
  host_stream stream;
  host_coordinator c(checkpoint_base_options());
  make(c);
  REQUIRE_NOTHROW(c.load_checkpoint(path, &stream));
  std::filesystem::remove(path);
  const auto loaded = c.host_optimizer().params(0);
  for (index_t col = 0; col < 6; ++col)
    for (index_t r = 0; r < 4; ++r) CHECK(loaded[col * 4 + r] == master[static_cast<std::size_t>(r * 6 + col)]);
}

TEST_CASE("the optimizer state loads onto parameters the trainer restored before registering them") {
  // The trainer restores its f32 weights, registers them with the initial masters of its first
  // run, then loads: registration must not write the parameters (the load reads their masters
  // from them), the 1-D parameter included.
  zenflow_options o = zenflow_options::dense();
  o.optimizer.lr = 0.1f;
  const std::vector<float> w_init(2 * 3, 1.0f), b_init(3, 1.0f);
  std::vector<float> w = w_init, b = b_init, g(6), gb(3);
  for (std::size_t i = 0; i < g.size(); ++i) g[i] = 0.1f * static_cast<float>(i + 1);
  for (std::size_t i = 0; i < gb.size(); ++i) gb[i] = -0.2f * static_cast<float>(i + 1);
  const auto path = temp_path("restored_first.bin");
  auto run = [&](host_coordinator& c, host_stream& s, int steps) {
    for (int step = 0; step < steps; ++step) {
      c.submit_gradient(0, const_matrix_view::row_major(g.data(), 2, 3, dtype::f32), &s);
      c.submit_gradient(1, const_vector_view(gb.data(), 3, dtype::f32), &s);
      c.step(&s);
      s.synchronize();
    }
  };
  auto make = [&](host_coordinator& c) {
    c.register_parameter("w", matrix_view::row_major(w.data(), 2, 3, dtype::f32),
                         const_matrix_view::row_major(w_init.data(), 2, 3, dtype::f32), dtype::f32);
    c.register_parameter("b", vector_view(b.data(), 3, dtype::f32), std::span<const float>(b_init));
  };
  std::vector<float> w_saved, b_saved, w_next, b_next;
  {
    host_stream s;
    host_coordinator c(o);
    make(c);
    run(c, s, 3);
    c.save_checkpoint(path, &s, checkpoint_contents::optimizer_state);
    w_saved = w, b_saved = b;
    run(c, s, 2);
    w_next = w, b_next = b;
  }
  w = w_saved, b = b_saved;  // the trainer's restore
  host_stream s;
  host_coordinator c(o);
  make(c);
  CHECK(w == w_saved);
  CHECK(b == b_saved);
  c.load_checkpoint(path, &s);
  std::filesystem::remove(path);
  s.synchronize();
  CHECK(w == w_saved);
  CHECK(b == b_saved);
  run(c, s, 2);
  CHECK(w == w_next);
  CHECK(b == b_next);
}

TEST_CASE("checkpoint_match::positions pairs renamed parameters by position; names rejects them") {
  // A model wrapped after the checkpoint was written (torch.compile's "_orig_mod.", DDP's
  // "module."): torch.optim loads by position, and so does positions.
  zenflow_options o;  // ZenFlow, async, two of six columns on the "GPU"
  o.topk_ratio = 0.34f;
  o.update_interval = interval_option::fixed(2);
  o.full_warm_up_rounds = 1;
  std::vector<float> w(4 * 6), b(3), g(4 * 6), gb(3);
  for (std::size_t i = 0; i < g.size(); ++i)
    w[i] = 0.01f * static_cast<float>(i), g[i] = 0.1f * std::sin(1.0f + static_cast<float>(i));
  for (std::size_t i = 0; i < gb.size(); ++i) gb[i] = -0.2f * static_cast<float>(i + 1);
  const std::vector<float> w_init = w, b_init = b;
  const auto path = temp_path("renamed.bin");
  auto make = [&](host_coordinator& c, const std::string& prefix, index_t rows) {
    c.register_parameter(prefix + "w", matrix_view::row_major(w.data(), rows, 24 / rows, dtype::f32),
                         const_matrix_view::row_major(w_init.data(), rows, 24 / rows, dtype::f32), dtype::f32);
    c.register_parameter(prefix + "b", vector_view(b.data(), 3, dtype::f32), std::span<const float>(b_init));
  };
  auto run = [&](host_coordinator& c, host_stream& s, int steps) {
    for (int step = 0; step < steps; ++step) {
      c.submit_gradient(0, const_matrix_view::row_major(g.data(), 4, 6, dtype::f32), &s);
      c.submit_gradient(1, const_vector_view(gb.data(), 3, dtype::f32), &s);
      c.step(&s);
      s.synchronize();
    }
  };
  std::vector<float> w_next, b_next;
  {
    host_stream s;
    host_coordinator c(o);
    make(c, "", 4);
    run(c, s, 3);
    c.save_checkpoint(path, &s);
    run(c, s, 3);
    c.finish(&s);
    w_next = w, b_next = b;
  }
  host_stream s;
  {
    host_coordinator renamed(o);
    make(renamed, "module.", 4);
    CHECK_THROWS_WITH_AS(renamed.load_checkpoint(path, &s), doctest::Contains("registered 'module.w'"), zenflow::error);
    host_coordinator reshaped(o);  // by position, the shapes must still agree
    make(reshaped, "module.", 6);
    CHECK_THROWS_WITH_AS(reshaped.load_checkpoint(path, &s, checkpoint_match::positions),
                         doctest::Contains("'module.w' has a different shape"), zenflow::error);
  }
  host_coordinator c(o);
  make(c, "module.", 4);
  c.load_checkpoint(path, &s, checkpoint_match::positions);
  std::filesystem::remove(path);
  CHECK(c.step_count() == 3);
  run(c, s, 3);
  c.finish(&s);
  CHECK(w == w_next);
  CHECK(b == b_next);
}

TEST_CASE("save_checkpoint with no parameters frees no buffer a copy still writes") {
  // The identity flags were copied into a buffer freed at the end of save_checkpoint, with
  // nothing waiting for the copy when no parameter follows (ThreadSanitizer: the delete races
  // the stream's memcpy).
  const auto path = temp_path("empty.bin");
  host_stream stream;
  host_coordinator empty{zenflow_options{}};
  for (int i = 0; i < 20; ++i) empty.save_checkpoint(path, &stream);
  host_coordinator fresh{zenflow_options{}};
  CHECK_NOTHROW(fresh.load_checkpoint(path, &stream));
  CHECK(fresh.step_count() == 0);
  std::filesystem::remove(path);
}

TEST_CASE("a directory, a device or a missing file is not a checkpoint") {
  const auto& c = configuration("pending");
  checkpoint_model m(c);
  const auto weights = m.snapshot();
  const auto cpu = m.cpu_state();
  const auto directory = temp_path("directory");
  std::filesystem::create_directory(directory);
  // A directory opens as a stream and reports a huge size: rejected as an error, not std::bad_alloc.
  CHECK_THROWS_WITH_AS(m.coordinator().load_checkpoint(directory, &m.stream()), doctest::Contains("not a regular file"),
                       zenflow::error);
  CHECK_THROWS_WITH_AS(m.coordinator().load_checkpoint("/dev/null", &m.stream()),
                       doctest::Contains("not a regular file"), zenflow::error);
  CHECK_THROWS_WITH_AS(m.coordinator().load_checkpoint(directory + "/missing.bin", &m.stream()),
                       doctest::Contains("cannot open"), zenflow::error);
  std::filesystem::remove(directory);
  check_untouched(m, weights, cpu);
  CHECK(resume(m, saved_checkpoint(c), 3) == uninterrupted(c, 3));
}

TEST_CASE("format 8 checks its payload with a CRC32C; format 7 (FNV-1a) still loads; other versions are refused") {
  const auto& c = configuration("pending");
  const auto file = saved_checkpoint(c);
  const auto header_field = [&](const std::vector<char>& bytes, std::size_t at, auto value) {
    std::memcpy(&value, bytes.data() + at, sizeof value);
    return value;
  };
  REQUIRE(header_field(file, 8, std::uint32_t{}) == 8);
  const auto* payload = reinterpret_cast<const std::byte*>(file.data()) + detail::checkpoint_header_bytes;
  const std::size_t payload_bytes = file.size() - detail::checkpoint_header_bytes;
  // The header holds the payload's CRC32C (RFC 3720, as zenflow::crc32c computes it), zero-extended.
  CHECK(header_field(file, 24, std::uint64_t{}) == zenflow::crc32c({payload, payload_bytes}));
  {  // the same file written by format 7: its FNV-1a 64 in the header
    auto v7 = file;
    const std::uint32_t seven = 7;
    std::memcpy(v7.data() + 8, &seven, sizeof seven);
    const std::uint64_t fnv = detail::fnv1a64({payload, payload_bytes});
    std::memcpy(v7.data() + 24, &fnv, sizeof fnv);
    checkpoint_model m(c);
    CHECK(resume(m, v7, 3) == uninterrupted(c, 3));
    auto flipped = v7;  // and a format 7 file is verified with its own checksum
    flipped[flipped.size() - 5] ^= 0x01;
    check_rejected(c, flipped, "is corrupted (checksum mismatch)");
    auto crc_in_v7 = file;  // a CRC32C where format 7 has its FNV-1a does not pass
    std::memcpy(crc_in_v7.data() + 8, &seven, sizeof seven);
    check_rejected(c, crc_in_v7, "is corrupted (checksum mismatch)");
  }
  for (const std::uint32_t version : {0u, 6u, 9u, 0xffffffffu}) {
    INFO("version " << version);
    auto other = file;
    std::memcpy(other.data() + 8, &version, sizeof version);
    reseal_checkpoint(other);
    check_rejected(c, other, "which this build does not read (it reads 7 to 8)");
  }
  for (const std::size_t at : {detail::checkpoint_header_bytes, file.size() / 2, file.size() - 1}) {
    INFO("byte " << at);
    auto flipped = file;  // any flipped bit of the payload is found
    flipped[at] ^= static_cast<char>(0x80);
    check_rejected(c, flipped, "is corrupted (checksum mismatch)");
  }
}

TEST_CASE("a byte flipped in any field is refused as corruption, whichever check it would break first") {
  // The load verifies the checksum after its validation (one read of the payload for both): a
  // field it parses or a value it validates may be corrupted, and the load names the corruption,
  // not the symptom, before anything changes.
  const auto& c = configuration("pending");
  const auto file = saved_checkpoint(c);
  checkpoint_model m(c);
  const auto weights = m.snapshot();
  const auto cpu = m.cpu_state();
  const auto path = temp_path("flipped.bin");
  std::size_t flipped_fields = 0;
  const checkpoint_document document(file);
  for (const auto& f : document.fields()) {
    if (f.bytes.empty()) continue;
    for (const std::size_t at : {f.offset, f.offset + f.bytes.size() - 1}) {
      INFO(f.name << " byte " << at - f.offset);
      auto flipped = file;
      flipped[at] ^= static_cast<char>(0x10);
      write_file_bytes(path, flipped);
      CHECK_THROWS_WITH_AS(m.coordinator().load_checkpoint(path, &m.stream()),
                           doctest::Contains("is corrupted (checksum mismatch)"), zenflow::error);
      check_untouched(m, weights, cpu);
    }
    ++flipped_fields;
  }
  CHECK(flipped_fields > 40);  // the options, the schedule, each parameter's fields and state arrays
  std::filesystem::remove(path);
  CHECK(resume(m, file, 3) == uninterrupted(c, 3));
}

namespace {
constexpr std::size_t reader_buffer_floats = detail::checkpoint_reader::buffer_bytes / sizeof(float);
struct two_arrays {
  std::string path;
  std::vector<float> first, second;
};
// A file of a byte, a float array longer than two reader buffers, a short one and "end" (the
// arrays start unaligned) at `path`.
two_arrays write_two_arrays(const std::string& path) {
  std::vector<float> large(2 * reader_buffer_floats + 3), small(17);
  for (std::size_t i = 0; i < large.size(); ++i) large[i] = static_cast<float>(i);
  for (std::size_t i = 0; i < small.size(); ++i) small[i] = -static_cast<float>(i);
  detail::checkpoint_writer w(path);
  w.put<std::uint8_t>(1);
  w.put_array<float>(large);
  w.put_array<float>(small);
  w.put_string("end");
  w.commit();
  return {path, std::move(large), std::move(small)};
}
}  // namespace

TEST_CASE("a deferred reader verifies what it read and what it skipped, read in any order, once") {
  const auto arrays = write_two_arrays(temp_path("deferred.bin"));
  const auto& path = arrays.path;
  const std::vector<float>& large = arrays.first;
  const std::vector<float>& small = arrays.second;
  const auto good = read_file_bytes(path);
  constexpr auto deferred = detail::checkpoint_verification::deferred;
  struct parsed {
    detail::checkpoint_array<float> large, small;
  };
  const auto parse = [](detail::checkpoint_reader& r) {
    CHECK(r.get<std::uint8_t>() == 1);
    parsed p{r.get_array_ref<float>(), r.get_array_ref<float>()};
    CHECK(r.get_string() == "end");
    return p;
  };
  // Parts of the large array out of order, overlapping each other and the parse buffer's window,
  // and leaving out [skip_first, skip_first + skip_size).
  const std::size_t skip_first = reader_buffer_floats + 1000, skip_size = 4096;
  const auto read_parts = [&](detail::checkpoint_reader& r, const parsed& p) {
    std::vector<float> part;
    const auto get = [&](std::size_t first, std::size_t n) {
      part.resize(n);
      r.read(p.large, first, std::span<float>(part));
      CHECK(std::equal(part.begin(), part.end(), large.begin() + static_cast<std::ptrdiff_t>(first)));
    };
    get(skip_first + skip_size, large.size() - skip_first - skip_size);
    get(reader_buffer_floats / 2, reader_buffer_floats / 2 + 7);
    get(0, reader_buffer_floats);
    get(reader_buffer_floats - 100, 200);  // overlaps both parts before
    get(reader_buffer_floats, 1000);
    CHECK(r.read(p.small) == small);
  };
  SUBCASE("an intact file: verify() reads only the part never read") {
    detail::checkpoint_reader r(path, deferred);
    CHECK_FALSE(r.verified());
    const auto p = parse(r);
    read_parts(r, p);
    const auto before = r.bytes_read();
    r.verify();
    CHECK(r.verified());
    CHECK(r.bytes_read() - before == skip_size * sizeof(float));
    r.verify();  // once
    CHECK(r.bytes_read() - before == skip_size * sizeof(float));
    CHECK(r.read(p.large) == large);  // reads go on after it
  }
  SUBCASE("an intact file read whole: verify() reads nothing") {
    detail::checkpoint_reader r(path, deferred);
    const auto p = parse(r);
    CHECK(r.read(p.large) == large);
    CHECK(r.read(p.small) == small);
    const auto before = r.bytes_read();
    r.verify();
    CHECK(r.bytes_read() == before);
  }
  SUBCASE("upfront (the default): the constructor reads the whole file") {
    detail::checkpoint_reader r(path);
    CHECK(r.verified());
    CHECK(r.bytes_read() >= good.size());
  }
  SUBCASE("a flipped bit is found where it was read (explicitly or in the parse buffer's window) or not") {
    for (const std::size_t element : {std::size_t{5}, reader_buffer_floats - 50, skip_first + 1, large.size() - 1}) {
      INFO("large[" << element << "] flipped");
      auto bad = good;
      const std::size_t at = detail::checkpoint_header_bytes + 1 + 8 + element * sizeof(float);
      bad[at] ^= 0x01;
      write_file_bytes(path, bad);
      {
        detail::checkpoint_reader r(path, deferred);  // the header is checked, the payload not yet
        const auto p = parse(r);
        std::vector<float> part(10);
        r.read(p.large, 0, std::span<float>(part));  // (the corrupted value may be read before verify)
        CHECK_THROWS_WITH_AS(r.verify(), doctest::Contains("is corrupted (checksum mismatch)"), error);
        CHECK_FALSE(r.verified());
        const auto before = r.bytes_read();  // a second call says so again, without reading
        CHECK_THROWS_WITH_AS(r.verify(), doctest::Contains("is corrupted (checksum mismatch)"), error);
        CHECK(r.bytes_read() == before);
      }
      {
        detail::checkpoint_reader r(path, deferred);
        CHECK(r.get<std::uint8_t>() == 1);
        // An array longer than the buffer is allocated and read only from a verified file.
        CHECK_THROWS_WITH_AS((void)r.get_array<float>(), doctest::Contains("is corrupted (checksum mismatch)"), error);
      }
      CHECK_THROWS_WITH_AS(detail::checkpoint_reader{path}, doctest::Contains("is corrupted (checksum mismatch)"),
                           error);
    }
  }
  std::filesystem::remove(path);
}

TEST_CASE("the writer streams arrays of any size through its buffer; the reader gets back every value") {
  // Checkpoints of the toy models above never fill the writer's buffer. A model's state does: its
  // arrays are flushed with what was buffered before them, or written straight through when they
  // are as large as the buffer, and the size and hash in the header cover all of it.
  constexpr std::size_t buffer_floats = detail::checkpoint_writer::buffer_bytes / sizeof(float);
  std::vector<std::vector<float>> arrays;
  for (const std::size_t n : {std::size_t{3}, buffer_floats + 5, buffer_floats / 2 + 1, buffer_floats / 2 + 1,
                              std::size_t{0}, 2 * buffer_floats, std::size_t{7}}) {
    arrays.emplace_back(n);
    for (std::size_t i = 0; i < n; ++i) arrays.back()[i] = static_cast<float>(arrays.size() * 1000003 + i);
  }
  const auto path = temp_path("stream.bin");
  {
    detail::checkpoint_writer w(path);
    w.put<std::int32_t>(-7);
    for (const auto& a : arrays) {
      w.put<std::uint8_t>(0x5a);  // a scalar between arrays: every array starts unaligned
      w.put_array<float>(a);
    }
    w.put_string("end");
    CHECK(std::filesystem::exists(path + ".tmp"));
    CHECK_FALSE(std::filesystem::exists(path));
    w.commit();
  }
  CHECK_FALSE(std::filesystem::exists(path + ".tmp"));
  detail::checkpoint_reader r(path);
  CHECK(r.get<std::int32_t>() == -7);
  for (const auto& a : arrays) {
    CHECK(r.get<std::uint8_t>() == 0x5a);
    CHECK(r.get_array<float>() == a);
  }
  CHECK(r.get_string() == "end");
  CHECK(r.at_end());
  {
    detail::checkpoint_writer abandoned(path);  // destroyed without commit (an exception on the way)
    abandoned.put_array<float>(arrays[1]);
  }
  CHECK_FALSE(std::filesystem::exists(path + ".tmp"));
  CHECK(detail::checkpoint_reader(path).get<std::int32_t>() == -7);  // the committed file is untouched
  std::filesystem::remove(path);
}

TEST_CASE("the reader skips arrays and reads them later, whole or in parts, in any order") {
  const auto arrays = write_two_arrays(temp_path("parts.bin"));
  const auto& path = arrays.path;
  const std::vector<float>& large = arrays.first;
  const std::vector<float>& small = arrays.second;
  detail::checkpoint_reader r(path);
  CHECK(r.get<std::uint8_t>() == 1);
  const auto large_at = r.get_array_ref<float>();
  const auto small_at = r.get_array_ref<float>();
  CHECK(large_at.size == large.size());
  CHECK(small_at.size == small.size());
  CHECK(r.get_string() == "end");  // parsing went on past the skipped arrays
  CHECK(r.at_end());
  CHECK(r.read(small_at) == small);
  std::vector<float> part(10);
  for (const std::size_t first : {std::size_t{0}, reader_buffer_floats - 4, large.size() - part.size()}) {
    INFO("first " << first);
    r.read(large_at, first, std::span<float>(part));
    CHECK(std::equal(part.begin(), part.end(), large.begin() + static_cast<std::ptrdiff_t>(first)));
    CHECK(r.read(large_at.part(first, part.size())) == part);
  }
  CHECK(r.read(large_at) == large);
  CHECK_THROWS_WITH_AS(r.read(small_at, small.size() - 1, std::span<float>(part).first(2)),
                       doctest::Contains("elements [16, 18) of an array of 17"), error);
  CHECK_THROWS_AS((void)small_at.part(18, 0), error);
  std::filesystem::remove(path);
}

TEST_CASE("the writer puts an array in parts, and only whole") {
  const auto path = temp_path("array_parts.bin");
  const std::vector<float> values = {1, 2, 3, 4, 5, 6, 7};
  {
    detail::checkpoint_writer w(path);
    w.begin_array<float>(values.size());
    w.put_elements(std::span<const float>(values).first(3));
    w.put_elements(std::span<const float>(values).subspan(3));
    w.put<std::int32_t>(9);
    w.commit();
  }
  detail::checkpoint_reader r(path);
  CHECK(r.get_array<float>() == values);
  CHECK(r.get<std::int32_t>() == 9);
  CHECK(r.at_end());
  detail::checkpoint_writer w(path);
  w.begin_array<float>(values.size());
  w.put_elements(std::span<const float>(values).first(6));
  CHECK_THROWS_WITH_AS(w.put_elements(std::span<const float>(values).first(2)),
                       doctest::Contains("2 elements past the end"), error);
  CHECK_THROWS_WITH_AS(w.put<std::int32_t>(9), doctest::Contains("before the array begun has its elements"), error);
  CHECK_THROWS_WITH_AS(w.commit(), doctest::Contains("committed before"), error);
  w.put_elements(std::span<const float>(values).last(1));
  w.commit();
  CHECK(detail::checkpoint_reader(path).get_array<float>() == values);  // the refused calls added nothing
  std::filesystem::remove(path);
}

TEST_CASE("the writer puts arrays side by side, in parts, in place; the file reads as if put one by one") {
  const auto path = temp_path("side_by_side.bin");
  const auto side_path = temp_path("side_by_side_reference.bin");
  // Larger than the writer's buffer, one empty, odd lengths: parts of the three interleaved.
  constexpr std::size_t big = detail::checkpoint_writer::buffer_bytes / sizeof(float) + 3;
  std::vector<std::vector<float>> arrays(3);
  arrays[0].resize(big);
  arrays[2].resize(1001);
  for (auto& a : arrays)
    for (std::size_t i = 0; i < a.size(); ++i) a[i] = static_cast<float>(i % 977) * 0.5f + static_cast<float>(a.size());
  const std::size_t sizes[3] = {arrays[0].size(), 0, arrays[2].size()};
  {
    detail::checkpoint_writer w(path);
    w.put<std::int32_t>(7);
    w.begin_arrays<float>(sizes);
    std::size_t done0 = 0, done2 = 0;
    for (std::size_t step : {std::size_t{5}, std::size_t{1} << 20, std::size_t{333}, big}) {
      const std::size_t n0 = std::min(step, big - done0), n2 = std::min(step / 2, arrays[2].size() - done2);
      w.put_part(2, std::span<const float>(arrays[2]).subspan(done2, n2));
      w.put_part(0, std::span<const float>(arrays[0]).subspan(done0, n0));
      done0 += n0;
      done2 += n2;
    }
    w.put_part(2, std::span<const float>(arrays[2]).subspan(done2));
    w.end_arrays();
    w.put<std::int32_t>(8);
    w.commit();
  }
  {
    detail::checkpoint_writer w(side_path);  // the same values put one after the other
    w.put<std::int32_t>(7);
    for (const auto& a : arrays) w.put_array<float>(a);
    w.put<std::int32_t>(8);
    w.commit();
  }
  CHECK(read_file_bytes(path) == read_file_bytes(side_path));  // header (size, checksum) included
  detail::checkpoint_reader r(path);
  CHECK(r.get<std::int32_t>() == 7);
  for (const auto& a : arrays) CHECK(r.get_array<float>() == a);
  CHECK(r.get<std::int32_t>() == 8);
  CHECK(r.at_end());
  // Misuse is refused, naming what is wrong, and adds nothing to the file.
  {
    detail::checkpoint_writer w(path);
    const std::size_t two[2] = {2, 3};
    w.begin_arrays<float>(two);
    const float x[4] = {1, 2, 3, 4};
    CHECK_THROWS_WITH_AS(w.put_part(2, std::span<const float>(x, 1)), doctest::Contains("array 2 of 2 begun"), error);
    CHECK_THROWS_WITH_AS(w.put_part(0, std::span<const float>(x, 3)), doctest::Contains("3 elements past the end"),
                         error);
    CHECK_THROWS_WITH_AS(w.put_part(0, std::span<const double>()), doctest::Contains("elements of 8 bytes"), error);
    w.put_part(0, std::span<const float>(x, 2));
    CHECK_THROWS_WITH_AS(w.end_arrays(), doctest::Contains("array 1 ended with 3 elements missing"), error);
    CHECK_THROWS_WITH_AS(w.put<std::int32_t>(1), doctest::Contains("before the arrays begun have ended"), error);
    CHECK_THROWS_WITH_AS(w.commit(), doctest::Contains("committed before"), error);
    CHECK_THROWS_WITH_AS(w.begin_arrays<float>(two), doctest::Contains("before the last ones have ended"), error);
    w.put_part(1, std::span<const float>(x, 3));
    w.end_arrays();
    w.commit();
  }
  detail::checkpoint_reader back(path);
  CHECK(back.get_array<float>() == std::vector<float>{1, 2});
  CHECK(back.get_array<float>() == std::vector<float>{1, 2, 3});
  CHECK(back.at_end());
  std::filesystem::remove(path);
  std::filesystem::remove(side_path);
}

TEST_CASE("the reader reads the file it opened: a checkpoint saved over it since does not change it") {
  const auto path = temp_path("held.bin");
  // Larger than the reader's buffer: the reads below go to the file.
  const std::size_t n = 2 * detail::checkpoint_reader::buffer_bytes / sizeof(float);
  auto save = [&](float value) {
    detail::checkpoint_writer w(path);
    w.put_array<float>(std::vector<float>(n, value));
    w.commit();
  };
  save(1.0f);
  detail::checkpoint_reader r(path);
  const auto at = r.get_array_ref<float>();
  SUBCASE("replaced by a save (a rename)") {
    save(2.0f);
    CHECK(r.read(at) == std::vector<float>(n, 1.0f));
    CHECK(detail::checkpoint_reader(path).get_array<float>() == std::vector<float>(n, 2.0f));
  }
  SUBCASE("cut short in place") {
    std::filesystem::resize_file(path, 100);
    CHECK_THROWS_WITH_AS(r.read(at), doctest::Contains("before the end it had when opened"), error);
  }
  std::filesystem::remove(path);
}

namespace {
// A host_coordinator with two weights and a bias whose CPU state spans several of the runs a load
// applies at a time (detail::checkpoint_run_bytes) and of the chunks it validates at a time: an f32
// weight (column-contiguous: its master is its values) and a bf16 one (row-major: its master is
// written).
class wide_model {
 public:
  static constexpr index_t rows0 = 64, cols0 = 30000, rows1 = 32, cols1 = 50000, bias_size = 100000;

  explicit wide_model(const zenflow_options& o) : coordinator_(o, config()) {
    static_assert(rows0 * 3 * sizeof(float) * cols0 > detail::checkpoint_run_bytes);
    static_assert(rows1 * 3 * sizeof(float) * cols1 > detail::checkpoint_run_bytes);
    static_assert(bias_size > detail::validation_chunk);
    w0_.resize(rows0 * cols0);
    g0_.resize(w0_.size());
    w1_.resize(rows1 * cols1);
    g1_.resize(w1_.size());
    bias_.assign(bias_size, 0.0f);
    bias_grad_.resize(bias_size);
    for (std::size_t i = 0; i < w0_.size(); ++i) w0_[i] = 0.01f * static_cast<float>(static_cast<int>(i % 29) - 14);
    std::vector<float> initial1(w1_.size());
    for (std::size_t i = 0; i < w1_.size(); ++i) {
      initial1[i] = 0.02f * static_cast<float>(static_cast<int>(i % 31) - 15);
      w1_[i] = from_float<bfloat16>(initial1[i]);
    }
    coordinator_.register_parameter("w0", matrix_view::column_contiguous(w0_.data(), rows0, cols0, dtype::f32),
                                    const_matrix_view::column_contiguous(w0_.data(), rows0, cols0, dtype::f32),
                                    dtype::f32);
    coordinator_.register_parameter("w1", matrix_view::row_major(w1_.data(), rows1, cols1, dtype::bf16),
                                    const_matrix_view::row_major(initial1.data(), rows1, cols1, dtype::f32),
                                    dtype::bf16);
    coordinator_.register_parameter("bias", vector_view{bias_.data(), bias_size, dtype::f32}, bias_);
  }
  host_coordinator& coordinator() noexcept { return coordinator_; }
  host_stream& stream() noexcept { return stream_; }

  void train(std::int64_t steps) {
    for (std::int64_t s = 0; s < steps; ++s) {
      stream_.synchronize();
      const float wobble = 0.01f * static_cast<float>(coordinator_.step_count() % 7);
      for (index_t c = 0; c < cols0; ++c) {  // every column its own scale: the selection matters
        const float scale = 0.1f + 0.001f * static_cast<float>((c * 37) % 1000);
        for (index_t r = 0; r < rows0; ++r) g0_[c * rows0 + r] = scale * (w0_[c * rows0 + r] - 0.05f) + wobble;
      }
      for (index_t r = 0; r < rows1; ++r)
        for (index_t c = 0; c < cols1; ++c) {
          const float scale = 0.1f + 0.001f * static_cast<float>((c * 53) % 1000);
          g1_[r * cols1 + c] = from_float<bfloat16>(scale * (to_float(w1_[r * cols1 + c]) + 0.05f) - wobble);
        }
      for (index_t i = 0; i < bias_size; ++i) bias_grad_[i] = bias_[i] - 0.01f * static_cast<float>(i % 11) + wobble;
      coordinator_.submit_gradient(0, const_matrix_view::column_contiguous(g0_.data(), rows0, cols0, dtype::f32),
                                   &stream_);
      coordinator_.submit_gradient(1, const_matrix_view::row_major(g1_.data(), rows1, cols1, dtype::bf16), &stream_);
      coordinator_.submit_gradient(2, const_vector_view{bias_grad_.data(), bias_size, dtype::f32}, &stream_);
      coordinator_.step(&stream_);
    }
    stream_.synchronize();
  }
  std::vector<std::byte> snapshot() {
    stream_.synchronize();
    return bytes_of(w0_, w1_, bias_);
  }
  /// Sets the weights to `bytes` (a snapshot()), as a trainer restores them itself.
  void restore(const std::vector<std::byte>& bytes) {
    stream_.synchronize();
    set_bytes(bytes, w0_, w1_, bias_);
  }

 private:
  static coordinator_config config() {
    coordinator_config c;
    c.cpu_threads = 2;
    return c;
  }
  std::vector<float> w0_, g0_, bias_, bias_grad_;
  std::vector<bfloat16> w1_, g1_;
  host_stream stream_;
  host_coordinator coordinator_;
};
}  // namespace

TEST_CASE("a state of several load runs per parameter loads, saves back identically and resumes bit-identically") {
  // The load reads each parameter's state from the file a run of columns at a time: every run
  // must land on its own columns, in every slot.
  auto async = checkpoint_base_options();  // mid-interval after 4 steps, a CPU result pending
  auto dense = zenflow_options::dense();
  dense.topk_ratio = 0.5f;
  struct run {
    const char* name;
    zenflow_options options;
    checkpoint_contents contents;
  };
  // (Members, not structured bindings: clang before 16 cannot capture those in INFO.)
  for (const run& c : {run{"zenflow", async, checkpoint_contents::optimizer_state},
                       run{"zenflow", async, checkpoint_contents::everything},
                       run{"dense", dense, checkpoint_contents::optimizer_state},
                       run{"zero_offload", zenflow_options::zero_offload(), checkpoint_contents::optimizer_state}}) {
    INFO(c.name << ", contents " << static_cast<int>(c.contents));
    const auto& options = c.options;
    const auto contents = c.contents;
    const auto path = temp_path("wide.bin");
    wide_model original(options);
    original.train(4);
    original.coordinator().save_checkpoint(path, &original.stream(), contents);
    const auto file = read_file_bytes(path);
    wide_model loaded(options);
    if (contents == checkpoint_contents::optimizer_state) loaded.restore(original.snapshot());
    REQUIRE_NOTHROW(loaded.coordinator().load_checkpoint(path, &loaded.stream()));
    CHECK(loaded.snapshot() == original.snapshot());
    std::filesystem::remove(path);
    loaded.coordinator().save_checkpoint(path, &loaded.stream(), contents);
    CHECK(read_file_bytes(path) == file);  // nothing of the state was lost, moved or invented
    std::filesystem::remove(path);
    original.train(3);
    loaded.train(3);
    CHECK(loaded.snapshot() == original.snapshot());
  }
}

TEST_CASE("a save holds a run of a parameter's state at a time, not the parameter's whole state") {
  // A bf16 weight of 1024 x 16384 (16.8M elements, 201 MB of CPU state: master, m, v), all of it on
  // the CPU (ZeRO-Offload). A save that exported the parameter's whole state (and copied its 34 MB
  // of values) added about 235 MB to the resident set at its peak; exported a run of columns
  // (checkpoint_run_bytes: 16 MiB) at a time, about 20 MB.
  constexpr index_t rows = 1024, cols = 16384;
  std::vector<bfloat16> weight(static_cast<std::size_t>(rows * cols), zenflow::to_bfloat16(0.25f));
  host_stream stream;
  host_coordinator c(zenflow_options::zero_offload());
  c.register_parameter("w", matrix_view::column_contiguous(weight.data(), rows, cols, dtype::bf16),
                       const_matrix_view::column_contiguous(weight.data(), rows, cols, dtype::bf16), dtype::bf16);
  const auto path = temp_path("run_wise.bin");
  std::ofstream("/proc/self/clear_refs") << "5";  // VmHWM := VmRSS
  const long long before = zenflow_test::status_bytes("VmRSS");
  c.save_checkpoint(path, &stream, checkpoint_contents::optimizer_state);
  const long long added = zenflow_test::status_bytes("VmHWM") - before;
  INFO("the save added " << added << " bytes at its peak");
  if (before > 0 && !zenflow_test::sanitizer_build) CHECK(added < (64ll << 20));
  // And the file holds every run: it loads, and saves back byte for byte.
  host_coordinator loaded(zenflow_options::zero_offload());
  loaded.register_parameter("w", matrix_view::column_contiguous(weight.data(), rows, cols, dtype::bf16),
                            const_matrix_view::column_contiguous(weight.data(), rows, cols, dtype::bf16), dtype::bf16);
  loaded.load_checkpoint(path, &stream);
  const auto file = read_file_bytes(path);
  loaded.save_checkpoint(path, &stream, checkpoint_contents::optimizer_state);
  CHECK(read_file_bytes(path) == file);
  std::filesystem::remove(path);
}

TEST_CASE("a bad moment past a state's first validation chunks is found before anything changes") {
  wide_model original(checkpoint_base_options());
  original.train(4);  // mid-interval: every kind of array in the file
  const auto path = temp_path("wide_bad.bin");
  original.coordinator().save_checkpoint(path, &original.stream());
  const auto file = read_file_bytes(path);
  constexpr std::size_t far = 3 * detail::validation_chunk + 5, near = detail::validation_chunk + 5;
  struct bad {
    const char* what;
    std::function<void(checkpoint_document&)> change;
    std::string reason;
  };
  const std::vector<bad> cases = {
      {"a CPU second moment", [](auto& d) { set_float(d["w0.cpu_v"].bytes, far, -1.0f); },
       "exp_avg_sq -1) at element " + std::to_string(far)},
      {"a 1-D parameter's first moment",
       [](auto& d) {
         const std::size_t master = d.template get<std::uint8_t>("bias.master") != 0 ? 1 : 0;
         set_float(d["bias.state"].bytes, master * wide_model::bias_size + near, std::nanf(""));
       },
       "at element " + std::to_string(near) + " ("},
      {"a GPU second moment",
       [](auto& d) { set_float(d["w1.compact"].bytes, compact_moment(d, "w1", 1000, 1, 7), -2.0f); },
       "at row 7 of selected column 1000"},
  };
  for (const auto& c : cases) {
    INFO(c.what);
    checkpoint_document d(file);
    c.change(d);
    write_file_bytes(path, d.file());
    wide_model loaded(checkpoint_base_options());
    const auto before = loaded.snapshot();
    CHECK_THROWS_WITH_AS(loaded.coordinator().load_checkpoint(path, &loaded.stream()),
                         doctest::Contains(c.reason.c_str()), error);
    CHECK(loaded.coordinator().step_count() == 0);
    CHECK(loaded.snapshot() == before);
  }
  std::filesystem::remove(path);
}

TEST_CASE("a failed save leaves no .tmp file and the previous checkpoint untouched") {
  const auto& c = configuration("pending");
  checkpoint_model m(c);
  m.train(c.steps);
  SUBCASE("the rename fails") {
    const auto directory = temp_path("save_target");  // a non-empty directory cannot be replaced by a file
    std::filesystem::create_directories(std::filesystem::path(directory) / "inside");
    CHECK_THROWS_WITH_AS(m.coordinator().save_checkpoint(directory, &m.stream()),
                         doctest::Contains(("' to '" + directory + "': Is a directory (errno 21)").c_str()),
                         zenflow::error);
    CHECK_FALSE(std::filesystem::exists(directory + ".tmp"));
    CHECK(std::filesystem::is_directory(std::filesystem::path(directory) / "inside"));
    std::filesystem::remove_all(directory);
  }
  SUBCASE("a write fails") {
    const auto path = temp_path("save_write.bin");
    m.coordinator().save_checkpoint(path, &m.stream());
    const auto previous = read_file_bytes(path);
    // A file size limit makes the write fail (EFBIG) instead of raising SIGXFSZ.
    rlimit saved{};
    REQUIRE(::getrlimit(RLIMIT_FSIZE, &saved) == 0);
    auto* const old_handler = std::signal(SIGXFSZ, SIG_IGN);
    rlimit small = saved;
    small.rlim_cur = 64;
    REQUIRE(::setrlimit(RLIMIT_FSIZE, &small) == 0);
    std::string message;
    try {
      m.coordinator().save_checkpoint(path, &m.stream());
    } catch (const zenflow::error& e) {
      message = e.what();
    }
    ::setrlimit(RLIMIT_FSIZE, &saved);
    std::signal(SIGXFSZ, old_handler);
    // The reason, not only that it failed (a full disk and a quota read alike otherwise).
    INFO(message);
    CHECK(message.find(".tmp' failed: File too large (errno 27)") != std::string::npos);
    CHECK_FALSE(std::filesystem::exists(path + ".tmp"));
    CHECK(read_file_bytes(path) == previous);
    std::filesystem::remove(path);
  }
  m.coordinator().finish(&m.stream());
  CHECK(m.snapshot() == uninterrupted(c, 0));  // the coordinator itself is unaffected
}

TEST_CASE("crafted checkpoints with a valid checksum are rejected before anything changes") {
  struct crafted {
    const char* configuration;
    const char* what;
    std::function<void(checkpoint_document&)> change;
    const char* reason;
  };
  const std::vector<crafted> cases = {
      {"pending", "steps no longer add up to the step", [](auto& d) { d.template set<std::int64_t>("steps", 2); },
       "inconsistent position"},
      {"before_first_step", "steps taken before the first step",
       [](auto& d) {
         d.template set<std::int64_t>("step", 5);
         d.template set<std::int64_t>("first_step", 5);
       },
       "inconsistent position"},
      {"pending", "the pending interval is not the previous one",
       [](auto& d) { d.template set<std::int64_t>("interval", 2); }, "pending interval"},
      {"pending", "an update interval target above update_interval",
       [](auto& d) { d.template set<std::int64_t>("target", 4); }, "target"},
      {"pending", "written by rank 1 of 2 data-parallel ranks",
       [](auto& d) {
         d.template set<std::int32_t>("rank", 1);
         d.template set<std::int32_t>("ranks", 2);
       },
       "rank 1 of 2"},
      {"pending", "written by 2 data-parallel ranks", [](auto& d) { d.template set<std::int32_t>("ranks", 2); },
       "same number of ranks"},
      {"pending", "a flag holding 2", [](auto& d) { d["started"].bytes[0] = 2; }, "flag"},
      {"pending", "update_interval's auto flag holding 2", [](auto& d) { d["options"].bytes[14] = 2; }, "flag"},
      // Another optimizer's checkpoint, or this optimizer's with another field table, would read
      // its per-parameter values as other fields.
      {"pending", "written for another optimizer", [](auto& d) { set_text(d["optimizer"].bytes, "sgd"); },
       "was written for optimizer 'sgd', this coordinator's is 'adam'"},
      {"pending", "written with another field table (lr no longer per group)",
       [](auto& d) {
         auto text = zenflow::field_table_text<zenflow::adam_options>();
         text.replace(text.find("lr (float, per group)"), 21, "lr (float)");
         set_text(d["optimizer_fields"].bytes, text);
       },
       "adam's hyper-parameter fields [lr (float), beta1"},
      {"pending", "written by an optimizer with other state slots",
       [](auto& d) { set_text(d["optimizer_slots"].bytes, "master, momentum_buffer"); },
       "holds adam state in slots [master, momentum_buffer], this coordinator's optimizers keep [master, exp_avg, "
       "exp_avg_sq]"},
      {"pending", "a NaN selection overlap",
       [](auto& d) { d.template set<double>("overlap", std::numeric_limits<double>::quiet_NaN()); }, "overlap"},
      {"pending", "more CPU updates than ended intervals",
       [](auto& d) { d.template set<std::int64_t>("host_steps", 5); }, "optimizer step counts"},
      {"pending", "more GPU updates than steps", [](auto& d) { d.template set<std::int64_t>("device_steps", 5); },
       "optimizer step counts"},
      {"pending", "more accumulated steps than the interval has",
       [](auto& d) { d.template set<std::int64_t>("current_count", 2); }, "accumulated step counts"},
      {"after_reselection", "a count for a pending interval that does not exist",
       [](auto& d) { d.template set<std::int64_t>("pending_count", 1); }, "accumulated step counts"},
      {"pending", "a selection of k - 1 columns (every size consistent with it)",
       [](auto& d) {
         const std::ptrdiff_t rows = checkpoint_model::rows1;
         d.resize_by("w1.selection", -1);
         d.resize_by("w1.compact", -3 * rows);
         for (const char* f : {"w1.cpu_p", "w1.cpu_m", "w1.cpu_v", "w1.accumulator"}) d.resize_by(f, rows);
         d.resize_by("w1.pending", rows * 4);
       },
       "selection of 1 columns"},
      {"zero_offload", "a selection in ZeRO-Offload mode",
       [](auto& d) {
         const std::ptrdiff_t rows = checkpoint_model::rows1;
         d.resize_by("w1.selection", 1);
         d.resize_by("w1.compact", 3 * rows);
         for (const char* f : {"w1.cpu_p", "w1.cpu_m", "w1.cpu_v"}) d.resize_by(f, -rows);
       },
       "selection of 1 columns"},
      {"pending", "a selection for one 2-D parameter only",
       [](auto& d) {
         const std::ptrdiff_t rows = checkpoint_model::rows1;
         d.resize_by("w1.selection", -2);
         d.resize_by("w1.compact", -6 * rows);
         for (const char* f : {"w1.cpu_p", "w1.cpu_m", "w1.cpu_v", "w1.accumulator"}) d.resize_by(f, 2 * rows);
         d.resize_by("w1.pending", 2 * rows * 4);
       },
       "all or none"},
      {"before_first_step", "an accumulator before the first step",
       [](auto& d) { d.resize_by("w0.accumulator", checkpoint_model::rows0 * checkpoint_model::cols0); },
       "inconsistent sizes"},
      {"after_reselection", "selected columns out of order",
       [](auto& d) {
         auto& s = d["w0.selection"].bytes;
         std::swap_ranges(s.begin(), s.begin() + 4, s.begin() + 4);
       },
       "ascending"},
      {"pending", "a NaN CPU moment", [](auto& d) { set_float(d["w1.cpu_m"].bytes, 3, std::nanf("")); }, "CPU moments"},
      {"pending_blockwise8_moments", "a negative CPU second moment",
       [](auto& d) { set_float(d["w0.cpu_v"].bytes, 0, -1.0f); }, "CPU moments"},
      // The GPU columns' moments ([master,] m, v per selected column) reach the CPU optimizer at a
      // reselection: a bad one must not load and fail the training later.
      {"pending", "a NaN GPU first moment",
       [](auto& d) { set_float(d["w1.compact"].bytes, compact_moment(d, "w1", 1, 0, 2), std::nanf("")); },
       "GPU moments"},
      {"pending", "a negative GPU second moment",
       [](auto& d) { set_float(d["w0.compact"].bytes, compact_moment(d, "w0", 0, 1, 3), -1e-10f); }, "GPU moments"},
      {"pending", "a negative second moment of a 1-D parameter ([master,] m, v)",
       [](auto& d) {
         auto& state = d["bias.state"].bytes;
         set_float(state, state.size() / sizeof(float) - 1, -1.0f);
       },
       "holds moments"},
      {"pending", "contents that are neither everything nor the optimizer state",
       [](auto& d) { d.template set<std::uint8_t>("contents", 2); }, "contents 2"},
      {"pending", "a bf16 parameter without its fp32 master",
       [](auto& d) {
         d.template set<std::uint8_t>("w0.master", 0);
         d.resize_by("w0.cpu_p", -static_cast<std::ptrdiff_t>(d["w0.cpu_p"].bytes.size() / 4));
       },
       "no fp32 master"},
      {"pending", "an f32 parameter without its master in a checkpoint of everything",
       [](auto& d) {
         d.template set<std::uint8_t>("w1.master", 0);
         d.resize_by("w1.cpu_p", -static_cast<std::ptrdiff_t>(d["w1.cpu_p"].bytes.size() / 4));
       },
       "no fp32 master"},
      {"pending", "a master flag without the master",
       [](auto& d) { d.resize_by("w1.cpu_p", -static_cast<std::ptrdiff_t>(d["w1.cpu_p"].bytes.size() / 4)); },
       "inconsistent sizes"},
      {"pending", "an accumulator with no counted step (the file omits all-zero ones)",
       [](auto& d) { d.template set<std::int64_t>("w1.current_count", 0); }, "inconsistent sizes"},
  };
  for (const auto& k : cases) {
    INFO(std::string(k.configuration) << ": " << std::string(k.what));
    const auto& c = configuration(k.configuration);
    checkpoint_document document(saved_checkpoint(c));
    k.change(document);
    check_rejected(c, document.file(), k.reason);
  }
}

TEST_CASE("a checkpoint far into training loads without memory per interval") {
  // The coordinator keeps counts for the live intervals only: an interval index of 2^40 (a
  // consistent position, step 2^40) loads and trains on.
  const auto& c = configuration("zero_offload");
  checkpoint_document document(saved_checkpoint(c));
  const std::int64_t huge = std::int64_t{1} << 40;
  const auto shift = huge - document.get<std::int64_t>("step");
  for (const char* f : {"step", "interval", "first_step"})
    document.set<std::int64_t>(f, document.get<std::int64_t>(f) + shift);
  checkpoint_model m(c);
  std::vector<std::byte> resumed;
  CHECK_NOTHROW(resumed = resume(m, document.file(), 3));
  CHECK(m.coordinator().step_count() == huge + 3);
}

}  // namespace ZENFLOW_TEST_FILE_ID
