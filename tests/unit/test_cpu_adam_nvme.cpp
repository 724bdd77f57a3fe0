// cpu_adam with its state on an SSD (cpu_adam_config::nvme), in both layouts (the moments only, or
// the fp32 master too): bit-identical to RAM state through steps over column subsets, every
// gradient and copy-out dtype, block-crossing tensors, chunking and threads; export/import and
// save/load interchangeable with RAM state; only the blocks a step touches move; a corrupted block
// fails the step before Adam sees it; a full disk at registration registers nothing; bad
// configurations and misuse are rejected by name.
#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <zenflow/concepts.hpp>
#include <zenflow/cpu_adam.hpp>

#include "../support/error_text.hpp"
#include "../support/storage_test_utils.hpp"

#include <doctest/doctest.h>

#include <cstring>
#include <random>
#include <vector>

#include "../support/test_file_id.hpp"

namespace ZENFLOW_TEST_FILE_ID {  // this file's names (tests/support/test_file_id.hpp)

using zenflow::cpu_adam;
using zenflow::cpu_adam_config;
using zenflow::cpu_adam_task;
using zenflow::dtype;
using zenflow::index_t;
using zenflow_test::contains;
using zenflow_test::error_of;

static_assert(zenflow::host_optimizer<cpu_adam>);

namespace {

constexpr std::size_t block_bytes = 4096;  // 512 elements of m and v per block: tensors cross blocks

using zenflow::cpu_state_format;

cpu_adam_config ram_config(std::size_t threads = 2, std::size_t chunk = 100,
                           cpu_state_format format = cpu_state_format::fp32) {
  return cpu_adam_config{threads, false, zenflow::cpu_isa::automatic, chunk, format};
}

// fp32 moments: master_on_disk false: the moments only ([m | v] blocks of 512 elements); true:
// [master | m | v] blocks of 336 elements (4096 / 12 rounded down to a multiple of 16). bf16
// moments: [words] blocks of 1024 elements, [master | words] of 512. 8-bit moments: 7 whole 8-bit
// blocks of up to 256 rows per block (4096 / 520), 2 with the master (4096 / 1544).
cpu_adam_config nvme_config(const zenflow_test::scratch_dir& dir, std::size_t threads = 2, std::size_t chunk = 100,
                            zenflow::io_engine_kind engine = zenflow::io_engine_kind::automatic,
                            bool master_on_disk = false, cpu_state_format format = cpu_state_format::fp32) {
  cpu_adam_config c = ram_config(threads, chunk, format);
  zenflow::nvme_state_config n;
  n.file.directory = dir.path();
  n.file.block_bytes = block_bytes;
  n.file.read_ahead = 2;
  n.file.write_behind = 2;
  n.file.pin = zenflow::pin_policy::none;
  n.engine = {engine, 8};
  n.master_on_disk = master_on_disk;
  c.nvme = n;
  return c;
}

zenflow::adam_options adamw() {
  zenflow::adam_options o;
  o.lr = 1e-2f;
  o.weight_decay = 0.05f;
  return o;
}

struct shape {
  index_t rows, cols;
};
const std::vector<shape> shapes{{37, 50}, {1000, 1}, {700, 3}, {8, 8}};

std::vector<float> values(std::size_t n, std::uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

void add_all(cpu_adam& o) {
  for (std::size_t t = 0; t < shapes.size(); ++t)
    o.add_tensor(values(static_cast<std::size_t>(shapes[t].rows * shapes[t].cols), 100 + static_cast<std::uint32_t>(t)),
                 shapes[t].rows, shapes[t].cols);
}

// Every column but those with c % 4 == step % 4 (a moving GPU selection), strictly ascending.
std::vector<std::int32_t> cpu_columns(index_t cols, int step) {
  std::vector<std::int32_t> out;
  for (index_t c = 0; c < cols; ++c)
    if (cols == 1 || c % 4 != step % 4) out.push_back(static_cast<std::int32_t>(c));
  return out;
}

struct state {
  std::vector<float> p, m, v;
};
state exported(const cpu_adam& o, std::size_t t) {
  const auto& s = shapes[t];
  std::vector<std::int32_t> all(static_cast<std::size_t>(s.cols));
  for (std::size_t c = 0; c < all.size(); ++c) all[c] = static_cast<std::int32_t>(c);
  const auto n = static_cast<std::size_t>(s.rows * s.cols);
  state out{std::vector<float>(n), std::vector<float>(n), std::vector<float>(n)};
  o.export_columns(t, all, out.p, out.m, out.v);
  return out;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// One step on both optimizers with the same tasks (gradient dtype and layout vary by step);
// returns whether the copy-outs match bit for bit.
bool step_both(cpu_adam& ram, cpu_adam& nvme, int step) {
  std::vector<std::vector<float>> g32(shapes.size());
  std::vector<std::vector<zenflow::bfloat16>> g16(shapes.size());
  std::vector<std::vector<std::int32_t>> cols(shapes.size());
  std::vector<std::vector<zenflow::bfloat16>> out_a(shapes.size()), out_b(shapes.size());
  std::vector<cpu_adam_task> tasks(shapes.size());
  const bool bf16_grad = step % 2 == 1, compact = step % 3 == 0;
  for (std::size_t t = 0; t < shapes.size(); ++t) {
    const auto& s = shapes[t];
    cols[t] = cpu_columns(s.cols, step);
    const std::size_t n =
        compact ? cols[t].size() * static_cast<std::size_t>(s.rows) : static_cast<std::size_t>(s.rows * s.cols);
    g32[t] = values(n, 1000u * static_cast<std::uint32_t>(step) + static_cast<std::uint32_t>(t), 0.1f);
    for (float x : g32[t]) g16[t].push_back(zenflow::to_bfloat16(x));
    out_a[t].assign(n, zenflow::to_bfloat16(0.0f));
    out_b[t].assign(n, zenflow::to_bfloat16(0.0f));
    tasks[t].tensor = t;
    tasks[t].columns = cols[t];
    tasks[t].grad_compact = compact;
    tasks[t].out_compact = compact;
    tasks[t].grad = bf16_grad ? static_cast<const void*>(g16[t].data()) : g32[t].data();
    tasks[t].grad_type = bf16_grad ? dtype::bf16 : dtype::f32;
  }
  std::vector<cpu_adam_task> tasks_b = tasks;
  for (std::size_t t = 0; t < shapes.size(); ++t)
    tasks[t].copy_out = out_a[t].data(), tasks_b[t].copy_out = out_b[t].data();
  // Tasks in another order on the SSD side: the blocks are streamed in file order whatever the order.
  std::reverse(tasks_b.begin(), tasks_b.end());
  const auto a = ram.step(tasks, 0.5f);
  const auto b = nvme.step(tasks_b, 0.5f);
  REQUIRE(a.applied == b.applied);
  bool same = true;
  for (std::size_t t = 0; t < shapes.size(); ++t)
    same = same && std::memcmp(out_a[t].data(), out_b[t].data(), out_a[t].size() * 2) == 0;
  return same;
}

}  // namespace

TEST_CASE("state on an SSD: bit-identical to RAM state over column subsets, dtypes, engines, threads, layouts") {
  // Plain variables, not structured bindings: doctest's CAPTURE captures them in a lambda, which
  // clang before 16 refuses for a binding.
  for (const auto& c :
       {std::pair{cpu_state_format::fp32, false}, std::pair{cpu_state_format::fp32, true},
        std::pair{cpu_state_format::bf16_moments, false}, std::pair{cpu_state_format::bf16_moments, true},
        std::pair{cpu_state_format::blockwise8_moments, false},
        std::pair{cpu_state_format::blockwise8_moments, true}}) {
    const cpu_state_format format = c.first;
    const bool master_on_disk = c.second;
    for (const auto engine : {zenflow::io_engine_kind::posix, zenflow::io_engine_kind::automatic}) {
      for (const std::size_t threads : {std::size_t{1}, std::size_t{2}}) {
        CAPTURE(zenflow::cpu_state_format_name(format));
        CAPTURE(master_on_disk);
        CAPTURE(static_cast<int>(engine));
        CAPTURE(threads);
        zenflow_test::scratch_dir dir;
        cpu_adam ram(adamw(), ram_config(threads, 100, format));
        cpu_adam nvme(adamw(), nvme_config(dir, threads, 100, engine, master_on_disk, format));
        // Blocks per tensor (1850, 1000, 2100 and 64 elements), each tensor on fresh blocks. 8-bit:
        // the tensors have 50, 4, 9 and 8 8-bit blocks (37 rows: one short block per column; 1000
        // and 700 rows: 256-row blocks and a short one), whole ones per state-file block.
        const std::size_t blocks = format == cpu_state_format::fp32 ? (master_on_disk ? 6 + 3 + 7 + 1 : 4 + 2 + 5 + 1)
                                   : format == cpu_state_format::bf16_moments
                                       ? (master_on_disk ? 4 + 2 + 5 + 1 : 2 + 1 + 3 + 1)
                                       : (master_on_disk ? 25 + 2 + 5 + 4 : 8 + 1 + 2 + 2);
        add_all(ram);
        add_all(nvme);
        CHECK(nvme.on_nvme());
        CHECK(nvme.master_on_nvme() == master_on_disk);
        REQUIRE(nvme.nvme_file() != nullptr);
        // Moments only: sized by the first call that touches the moments. Master on disk: every
        // tensor's blocks are written at add_tensor.
        CHECK(nvme.nvme_file()->block_count() == (master_on_disk ? blocks : 1u));
        if (master_on_disk)  // the initial master is on disk, the moments 0
          for (std::size_t t = 0; t < shapes.size(); ++t) {
            const state a = exported(ram, t), b = exported(nvme, t);
            CHECK(same_bits(a.p, b.p));
            CHECK(same_bits(a.m, b.m));
            CHECK(same_bits(a.v, b.v));
          }
        for (int s = 0; s < 7; ++s) CHECK(step_both(ram, nvme, s));
        REQUIRE(nvme.nvme_file() != nullptr);
        CHECK(nvme.step_count() == 7);
        for (std::size_t t = 0; t < shapes.size(); ++t) {
          const state a = exported(ram, t), b = exported(nvme, t);
          CHECK(same_bits(a.p, b.p));
          CHECK(same_bits(a.m, b.m));
          CHECK(same_bits(a.v, b.v));
          if (!master_on_disk)
            CHECK(std::memcmp(ram.params(t).data(), nvme.params(t).data(), ram.params(t).size_bytes()) == 0);
        }
        CHECK(nvme.nvme_file()->block_count() == blocks);
        CHECK(nvme.nvme_file()->counters().checksum_failures == 0);
        // RAM holds the master only (4 bytes per element), or nothing.
        CHECK(nvme.host_state_bytes() == (master_on_disk ? 0 : (1850 + 1000 + 2100 + 64) * sizeof(float)));
        CHECK(nvme.state_bytes() == ram.state_bytes());
        if (master_on_disk) CHECK(contains(error_of([&] { (void)nvme.params(0); }), "nvme"));
      }
    }
  }
}

TEST_CASE("moments on an SSD: a step with a non-finite gradient changes nothing and moves no block") {
  zenflow_test::scratch_dir dir;
  cpu_adam ram(adamw(), ram_config());
  cpu_adam nvme(adamw(), nvme_config(dir));
  add_all(ram);
  add_all(nvme);
  REQUIRE(step_both(ram, nvme, 0));
  const state before = exported(nvme, 0);
  auto* file = nvme.nvme_file();
  REQUIRE(file != nullptr);
  const auto written = file->counters().bytes_written;
  std::vector<float> g(37 * 50, 0.0f);
  g[777] = std::numeric_limits<float>::quiet_NaN();
  cpu_adam_task task;
  task.tensor = 0;
  task.grad = g.data();
  CHECK_FALSE(nvme.step({&task, 1}).applied);
  CHECK(file->counters().bytes_written == written);
  const state after = exported(nvme, 0);
  CHECK(same_bits(before.m, after.m));
  CHECK(same_bits(before.p, after.p));
}

TEST_CASE("moments on an SSD: a step reads and writes only the blocks its columns touch") {
  zenflow_test::scratch_dir dir;
  cpu_adam nvme(adamw(), nvme_config(dir));
  add_all(nvme);  // tensor 2 (700 x 3) is blocks 6..10
  std::vector<float> g(700, 0.25f);
  const std::int32_t column[] = {1};  // elements 700..1399: blocks 7 and 8 of the file (slots 188..)
  cpu_adam_task task;
  task.tensor = 2;
  task.grad = g.data();
  task.columns = column;
  task.grad_compact = true;
  REQUIRE(nvme.step({&task, 1}).applied);
  const auto& c = nvme.nvme_file()->counters();
  CHECK(c.bytes_read == 2 * block_bytes);
  CHECK(c.bytes_written == 2 * block_bytes);
  const state s = exported(nvme, 2);
  for (std::size_t i = 0; i < 2100; ++i) {
    const bool updated = i >= 700 && i < 1400;
    if ((s.m[i] != 0.0f) != updated) FAIL_CHECK("element " << i << " m " << s.m[i]);
  }
}

namespace {
void check_interchange(bool master_on_disk, cpu_state_format format) {
  CAPTURE(master_on_disk);
  CAPTURE(zenflow::cpu_state_format_name(format));
  zenflow_test::scratch_dir dir;
  cpu_adam ram(adamw(), ram_config(2, 100, format));
  cpu_adam nvme(adamw(), nvme_config(dir, 2, 100, zenflow::io_engine_kind::automatic, master_on_disk, format));
  add_all(ram);
  add_all(nvme);
  for (int s = 0; s < 3; ++s) REQUIRE(step_both(ram, nvme, s));
  // save_state writes the bytes of the same format in RAM: each side loads the other's.
  for (std::size_t t = 0; t < shapes.size(); ++t) {
    std::vector<std::byte> a(ram.saved_state_size(t)), b(nvme.saved_state_size(t));
    ram.save_state(t, a);
    nvme.save_state(t, b);
    CHECK(a == b);
  }
  // Import columns 3 and 40..42 of tensor 0 from fresh values; export gives them back (fp32; bf16:
  // as RAM state encodes them), the rest unchanged.
  const std::int32_t cols[] = {3, 40, 41, 42};
  const std::size_t n = 4 * 37;
  const auto p = values(n, 7), m = values(n, 8);
  auto v = values(n, 9);
  for (auto& x : v) x = x * x;
  const state before = exported(nvme, 0);
  nvme.import_columns(0, cols, p, m, v);
  ram.import_columns(0, cols, p, m, v);
  std::vector<float> p2(n), m2(n), v2(n), p3(n), m3(n), v3(n);
  nvme.export_columns(0, cols, p2, m2, v2);
  ram.export_columns(0, cols, p3, m3, v3);
  CHECK(same_bits(p, p2));
  CHECK(same_bits(m3, m2));
  CHECK(same_bits(v3, v2));
  if (format == cpu_state_format::fp32) CHECK((same_bits(m, m2) && same_bits(v, v2)));
  const state after = exported(nvme, 0);
  for (std::size_t i = 0; i < 37 * 50; ++i) {
    const std::size_t c = i / 37;
    if (c == 3 || (c >= 40 && c <= 42)) continue;
    if (after.p[i] != before.p[i] || after.m[i] != before.m[i] || after.v[i] != before.v[i])
      FAIL_CHECK("element " << i << " changed");
  }
  // A RAM save loads into the SSD side and both keep stepping identically.
  for (std::size_t t = 0; t < shapes.size(); ++t) {
    std::vector<std::byte> a(ram.saved_state_size(t));
    ram.save_state(t, a);
    nvme.load_state(t, a);
  }
  for (int s = 3; s < 6; ++s) CHECK(step_both(ram, nvme, s));
  for (std::size_t t = 0; t < shapes.size(); ++t) CHECK(same_bits(exported(ram, t).v, exported(nvme, t).v));
  // A non-finite moment is rejected before anything changes.
  auto bad = m;
  bad[5] = std::numeric_limits<float>::infinity();
  const state kept = exported(nvme, 0);
  CHECK(contains(error_of([&] { nvme.import_columns(0, cols, p, bad, v); }), "exp_avg"));
  CHECK(same_bits(kept.m, exported(nvme, 0).m));
  CHECK(same_bits(kept.p, exported(nvme, 0).p));
}
}  // namespace

TEST_CASE("state on an SSD: export, import, save and load interchange with RAM state in both layouts") {
  for (const auto format :
       {cpu_state_format::fp32, cpu_state_format::bf16_moments, cpu_state_format::blockwise8_moments}) {
    CAPTURE(zenflow::cpu_state_format_name(format));
    check_interchange(false, format);
    check_interchange(true, format);
  }
}

TEST_CASE("state on an SSD: a corrupted block fails the step with its offset; Adam never sees it") {
  for (const bool master_on_disk : {false, true}) {
    CAPTURE(master_on_disk);
    zenflow_test::scratch_dir dir;
    cpu_adam nvme(adamw(), nvme_config(dir, 1, 100, zenflow::io_engine_kind::automatic, master_on_disk));
    add_all(nvme);
    std::vector<float> g(37 * 50, 0.1f);
    cpu_adam_task task;
    task.tensor = 0;
    task.grad = g.data();
    REQUIRE(nvme.step({&task, 1}).applied);
    const std::vector<float> params_before = exported(nvme, 0).p;
    {  // flip a byte of block 2 behind the optimizer's back (its m, or its master)
      const int fd = ::open(nvme.nvme_file()->path().c_str(), O_WRONLY);
      REQUIRE(fd >= 0);
      const unsigned char garbage = 0x5a;
      REQUIRE(::pwrite(fd, &garbage, 1, 2 * block_bytes + 100) == 1);
      ::close(fd);
    }
    const std::string e = error_of([&] { nvme.step({&task, 1}); });
    INFO(e);
    CHECK(contains(e, "block 2"));
    CHECK(contains(e, "CRC32C"));
    CHECK(nvme.step_count() == 1);
    CHECK(nvme.nvme_file()->counters().checksum_failures == 1);
    if (master_on_disk) {  // exporting the corrupted block's columns fails the same way; another tensor exports
      CHECK(contains(error_of([&] { (void)exported(nvme, 0); }), "CRC32C"));
      CHECK(exported(nvme, 1).p.size() == 1000);
      continue;
    }
    // The blocks before it were updated and written back (the step failed midway: documented); the
    // master of the corrupted block's elements was not touched.
    for (std::size_t i = 2 * 512; i < 3 * 512; ++i)
      if (nvme.params(0)[i] != params_before[i]) FAIL_CHECK("element " << i << " of the bad block was updated");
  }
}

TEST_CASE("moments on an SSD: bad configurations and misuse are rejected by name") {
  zenflow_test::scratch_dir dir;
  {
    auto c = nvme_config(dir);
    c.nvme->file.directory = dir.path() / "missing";
    CHECK(contains(error_of([&] { cpu_adam o(adamw(), c); }), "config.nvme.directory"));
  }
  {
    auto c = nvme_config(dir);
    c.nvme->file.block_bytes = 1000;
    CHECK(contains(error_of([&] { cpu_adam o(adamw(), c); }), "config.nvme.block_bytes"));
    c.nvme->file.block_bytes = 0;  // the setting given, not the file's size cpu_adam derives from it
    CHECK(contains(error_of([&] { cpu_adam o(adamw(), c); }), "config.nvme.block_bytes: must be a positive multiple"));
  }
  {  // two optimizers on one file: the second fails at construction
    cpu_adam first(adamw(), nvme_config(dir));
    CHECK(contains(error_of([&] { cpu_adam second(adamw(), nvme_config(dir)); }), "in use by another process"));
  }
  cpu_adam o(adamw(), nvme_config(dir));
  add_all(o);
  CHECK(contains(error_of([&] { (void)o.exp_avg(0); }), "nvme"));
  (void)exported(o, 0);  // sizes the file
  CHECK(contains(error_of([&] { o.add_tensor(std::vector<float>(4), 2, 2); }), "register every tensor first"));
}

TEST_CASE("master on an SSD: tensors may be added after a step; a full disk at add_tensor registers nothing") {
  zenflow_test::scratch_dir dir;
  {
    cpu_adam ram(adamw(), ram_config());
    cpu_adam nvme(adamw(), nvme_config(dir, 2, 100, zenflow::io_engine_kind::automatic, true));
    add_all(ram);
    add_all(nvme);
    REQUIRE(step_both(ram, nvme, 0));
    const auto extra = values(300 * 5, 77);
    CHECK(nvme.add_tensor(extra, 300, 5) == 4);
    ram.add_tensor(extra, 300, 5);
    CHECK(nvme.nvme_file()->block_count() == 17 + 5);
    CHECK(same_bits(exported(nvme, 0).p, exported(ram, 0).p));
    std::vector<float> p(1500), m(1500), v(1500);
    const std::int32_t all[] = {0, 1, 2, 3, 4};
    nvme.export_columns(4, all, p, m, v);
    CHECK(same_bits(p, extra));
  }
  // RLIMIT_FSIZE stands in for a full disk (fallocate fails with EFBIG), in a child process.
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    int code = 0;
    try {
      ::signal(SIGXFSZ, SIG_IGN);
      cpu_adam o(adamw(), nvme_config(dir, 1, 100, zenflow::io_engine_kind::posix, true));
      o.add_tensor(values(336 * 4, 1), 336, 4);  // 4 blocks
      const rlimit limit{16 * block_bytes, 16 * block_bytes};
      if (::setrlimit(RLIMIT_FSIZE, &limit) != 0) ::_exit(10);
      std::string e;
      try {
        o.add_tensor(values(336 * 20, 2), 336, 20);  // 20 more blocks: past the limit
      } catch (const zenflow::error& x) {
        e = x.what();
      }
      if (!contains(e, "config.nvme.bytes") || !contains(e, "largest file allowed")) code |= 1;
      if (o.tensor_count() != 1) code |= 2;
      // The first tensor is intact; a tensor that fits is still accepted after the failure.
      std::vector<float> p(336 * 4), m(p.size()), v(p.size());
      const std::int32_t cols[] = {0, 1, 2, 3};
      o.export_columns(0, cols, p, m, v);
      if (!same_bits(p, values(336 * 4, 1))) code |= 4;
      if (o.add_tensor(values(336, 3), 336, 1) != 1) code |= 8;
    } catch (...) {
      code |= 16;
    }
    ::_exit(code);
  }
  int status = 0;
  REQUIRE(::waitpid(pid, &status, 0) == pid);
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
}

}  // namespace ZENFLOW_TEST_FILE_ID
