// The data-parallel coordinator under mpirun (2 and 3 ranks): N ranks on N micro-batches against
// one process on their mean gradient, the CPU state each rank holds, an edit of the parameters
// reloaded on every rank, agreement checks, failure on every rank, and per-rank checkpoints.
//
// The gradients (support/data_parallel_model.hpp) make every sum over ranks exact, and the scores
// of the mean gradient rank the columns as the summed scores do: the selection is the mean's
// (checked at every step, as the write-back schedule). One set of gradients scales one pattern per
// rank (every rank's own top-k is the selection); the other gives each rank top columns of its own
// (only the all-reduced scores select what one process selects). Without clipping 2 ranks equal
// one process bit for bit, parameters and CPU state. On 3 ranks, and with clipping (on about half
// the steps, so that a wrong 1/N or clip factor changes the scale between steps, which Adam does
// not hide), the mean's 1/3 and the clip factor are applied to the reduced sum in fp32 as the CPU
// columns accumulate, where one process scales its own gradient (the sums round differently). Then the
// moments (m, v) agree at every element within 1e-2 x (|b| + rms b) for bf16 gradients (a few bf16
// roundings) and 1e-3 for f32 ones (measured at most 4.7e-3 and 1.1e-7 relative to |b| + rms b), and
// parameters and masters within the same tolerances but for at most 1 element in 100: where an
// element's mean gradient cancels, Adam turns the last bits into an update of up to lr.
#include <zenflow/coordinator.hpp>
#include <zenflow/mpi_communicator.hpp>

#include <doctest/doctest.h>

#include <unistd.h>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "../support/coordinator_instances.hpp"
#include "../support/data_parallel_model.hpp"
#include "../support/error_text.hpp"
#include "../support/exported_state.hpp"
#include "mpi_coordinator_instance.hpp"
#include "mpi_doctest.hpp"

using namespace std::chrono_literals;
using zenflow::bfloat16;
using zenflow::dtype;
using zenflow::host_stream;
using zenflow::missing_gradients;
using zenflow_test::contains;
using zenflow_test::error_of;
using zenflow_test::same_on_every_rank;
using zenflow_test::world_rank;
using zenflow_test::world_size;

namespace {

zenflow::mpi_communicator_options test_options() {
  zenflow::mpi_communicator_options o;
  o.timeout = 20s;  // a bug shows up as a timeout, not a hang
  return o;
}

using model = zenflow_test::data_parallel_model;
using zenflow_test::far;
using zenflow_test::scenario;
using zenflow_test::threshold_between;
using zenflow_test::w1_values;
using zenflow_test::w2_missing;

using dp_coordinator = zenflow::data_parallel_host_coordinator<zenflow::mpi_communicator>;

// Rank 0's process id, the same on every rank: a file name every rank agrees on.
std::string shared_prefix() {
  long pid = static_cast<long>(getpid());
  MPI_Bcast(&pid, 1, MPI_LONG, 0, MPI_COMM_WORLD);
  return "/tmp/zenflow_dp_" + std::to_string(pid);
}

// The trainer's edit at a step (the same on every rank and in the reference): w1 (bf16) clamped,
// w2 halved, the bias zeroed; then every parameter reloaded.
template <class Model, class C, class Stream>
void edit_and_reload(Model& m, C& c, Stream stream) {
  for (auto& x : m.w1) x = zenflow::to_bfloat16(std::fmax(-0.125f, std::fmin(0.125f, zenflow::to_float(x))));
  for (auto& x : m.w2) x *= 0.5f;
  for (auto& x : m.b) x = 0.0f;
  for (std::size_t i = 0; i < 3; ++i) c.reload_parameter(i, stream);
}

// Runs 14 steps of N ranks and of the reference (one process on the mean gradient) side by side:
// the same selection and write-back schedule at every step, the same parameters on every rank,
// and parameters and this rank's CPU state (master, m, v) as the reference's, bit for bit or
// within the scenario's tolerance. With `edit_at` >= 0, the trainer edits the parameters before
// that step's backward.
template <class Model>
void run_against_reference(const scenario& how, int edit_at = -1, std::int64_t select_interval = 3) {
  const int rank = world_rank(), ranks = world_size(), steps = 14;
  const auto norms = zenflow_test::mean_gradient_norms<Model>(steps, ranks, how.rank_specific);
  const float max_grad_norm = how.clip ? threshold_between(norms) : 0.0f;
  if (how.clip) {  // the premise: clipping changes the scale between steps (Adam is invariant to one scale)
    const auto clipped = std::count_if(norms.begin(), norms.end(), [&](double x) { return x > max_grad_norm; });
    REQUIRE(clipped >= 3);
    REQUIRE(clipped <= steps - 3);
  }
  auto options = zenflow_test::data_parallel_test_options(max_grad_norm);
  options.select_interval = zenflow::interval_option::fixed(select_interval);
  zenflow::mpi_communicator comm(MPI_COMM_WORLD, test_options());
  Model dp_model, ref_model;
  dp_coordinator dp(comm, options);
  zenflow::host_coordinator ref(options);
  dp_model.register_with(dp);
  ref_model.register_with(ref);
  REQUIRE(dp.rank() == rank);
  REQUIRE(dp.ranks() == ranks);
  host_stream s_dp, s_ref;
  int own_choice_differs = 0;  // selections at which this rank's own top-k was not the selection
  double worst_params = 0.0;   // the largest fraction of parameter elements beyond the tolerance
  for (int t = 0; t < steps; ++t) {
    if (t == edit_at) {
      edit_and_reload(dp_model, dp, &s_dp);
      edit_and_reload(ref_model, ref, &s_ref);
    }
    if (how.rank_specific) {
      dp_model.make_rank_specific_gradients(t, rank, ranks);
      ref_model.make_rank_specific_gradients(t, -1, ranks);
    } else {
      dp_model.make_gradients(t, rank, ranks);
      ref_model.make_gradients(t, -1, ranks);
    }
    // This rank's own top-k columns of w1 (its gradient's column L1 norms; before the step, which
    // writes the selected columns' sums over the ranks into the gradient).
    std::vector<std::pair<float, std::int32_t>> scores;
    for (std::int32_t c = 0; c < static_cast<std::int32_t>(Model::c1); ++c) {
      float l1 = 0.0f;
      for (std::size_t r = 0; r < Model::r1; ++r) l1 += std::fabs(zenflow::to_float(dp_model.g1[r * Model::c1 + c]));
      scores.push_back({-l1, c});
    }
    std::sort(scores.begin(), scores.end());
    dp_model.submit(dp, &s_dp, !w2_missing(t));
    ref_model.submit(ref, &s_ref, !w2_missing(t));
    const auto& m = dp.step(&s_dp, missing_gradients::skip);
    const auto& mr = ref.step(&s_ref, missing_gradients::skip);
    s_dp.synchronize();
    s_ref.synchronize();
    CAPTURE(t);
    CHECK(m.reselected == mr.reselected);
    CHECK(m.written_back == mr.written_back);
    for (std::size_t i = 0; i < 2; ++i) {
      const auto sel = dp.gpu_columns(i), ref_sel = ref.gpu_columns(i);
      CHECK(std::vector<std::int32_t>(sel.begin(), sel.end()) ==
            std::vector<std::int32_t>(ref_sel.begin(), ref_sel.end()));
    }
    if (m.reselected && how.rank_specific) {
      std::vector<std::int32_t> own;
      for (std::size_t j = 0; j < dp.gpu_columns(0).size(); ++j) own.push_back(scores[j].second);
      std::sort(own.begin(), own.end());
      own_choice_differs += own != std::vector<std::int32_t>(dp.gpu_columns(0).begin(), dp.gpu_columns(0).end());
    }
    CHECK(same_on_every_rank(dp_model.bytes()));
    if (how.exact) {
      CHECK(dp_model.bytes() == ref_model.bytes());
    } else {
      // Within a few roundings of the stored dtype (bf16 w1, f32 w2 and b), but for at most 1 in
      // 100 elements: where an element's mean gradient cancels, Adam turns the last bits into an
      // update of up to lr.
      const std::size_t n = dp_model.w1.size() + dp_model.w2.size() + dp_model.b.size();
      const std::size_t apart = far(w1_values(dp_model), w1_values(ref_model), 1e-2f) +
                                far(dp_model.w2, ref_model.w2, how.tolerance) +
                                far(dp_model.b, ref_model.b, how.tolerance);
      CHECK(apart <= std::max<std::size_t>(1, n / 100));
      worst_params = std::max(worst_params, static_cast<double>(apart) / static_cast<double>(n));
    }
  }
  if (how.rank_specific) CHECK(own_choice_differs >= 3);
  dp.finish(&s_dp);
  ref.finish(&s_ref);
  if (how.exact) CHECK(dp_model.bytes() == ref_model.bytes());
  CHECK(same_on_every_rank(dp_model.bytes()));
  // This rank's CPU state: its own columns of the reference's, and nothing else.
  std::size_t held = 0, total = 0;
  float worst[3] = {0.0f, 0.0f, 0.0f};  // master, m, v: |a - b| / (|b| + rms(b))
  for (std::size_t i = 0; i < 2; ++i) {
    const auto range = dp.owned_columns(i);
    const std::size_t rows = i == 0 ? Model::r1 : Model::r2, cols = i == 0 ? Model::c1 : Model::c2;
    CHECK(range.first == static_cast<zenflow::index_t>(cols * rank / ranks));
    CHECK(range.last == static_cast<zenflow::index_t>(cols * (rank + 1) / ranks));
    const auto& host = dp.host_optimizer();
    const auto& ref_host = ref.host_optimizer();
    const auto tensor = i;  // registered in order: w1 is tensor 0, w2 tensor 1
    REQUIRE(host.params(tensor).size() == rows * static_cast<std::size_t>(range.size()));
    held += 3 * host.params(tensor).size() * sizeof(float);
    total += 3 * ref_host.params(tensor).size() * sizeof(float);
    const std::size_t at = rows * static_cast<std::size_t>(range.first), n = host.params(tensor).size();
    // The moments, linear and quadratic in the gradients, agree within a few roundings of the
    // gradient's dtype (w1's are bf16: the reference rounds its clipped gradient to bf16, the
    // ranks scale the reduced sum in fp32) at every element; a wrong 1/N or clip factor moves
    // them by a factor. The masters, as the parameters: at most 1 in 100 elements apart.
    const float moments = i == 0 ? 1e-2f : how.tolerance;
    int part = 0;
    for (const auto& [mine, theirs] : {std::pair{host.params(tensor), ref_host.params(tensor)},
                                       std::pair{host.exp_avg(tensor), ref_host.exp_avg(tensor)},
                                       std::pair{host.exp_avg_sq(tensor), ref_host.exp_avg_sq(tensor)}}) {
      const auto want = std::span<const float>(theirs).subspan(at, n);
      if (how.exact)
        CHECK(zenflow_test::state_apart(std::span<const float>(mine), want, true, 0.0f) == 0);
      else if (part == 0)
        CHECK(far(mine, want, how.tolerance) <= std::max<std::size_t>(1, n / 100));
      else
        CHECK(far(mine, want, moments) == 0);
      double squares = 0.0;
      for (std::size_t e = 0; e < n; ++e) squares += static_cast<double>(want[e]) * want[e];
      const float rms = static_cast<float>(std::sqrt(squares / static_cast<double>(n)));
      for (std::size_t e = 0; e < n; ++e)
        worst[part] = std::max(worst[part], std::fabs(mine[e] - want[e]) / (std::fabs(want[e]) + rms));
      ++part;
    }
    CHECK(dp.cpu_step_count(i) == ref.cpu_step_count(i));
    CHECK(dp.gpu_step_count(i) == ref.gpu_step_count(i));
  }
  // 1/N of the CPU state per rank, to within one column per parameter; the ranks hold it all once.
  long long sum = static_cast<long long>(held);
  MPI_Allreduce(MPI_IN_PLACE, &sum, 1, MPI_LONG_LONG, MPI_SUM, MPI_COMM_WORLD);
  CHECK(sum == static_cast<long long>(total));
  const double per_column = 3.0 * 4 * (Model::r1 + Model::r2);
  CHECK(std::fabs(static_cast<double>(held) - static_cast<double>(total) / ranks) <= per_column);
  MPI_Allreduce(MPI_IN_PLACE, worst, 3, MPI_FLOAT, MPI_MAX, MPI_COMM_WORLD);
  if (rank == 0)
    MESSAGE("CPU state per rank: ", held, " of ", total, " bytes (", static_cast<double>(held) / total, ") on ", ranks,
            " ranks; largest difference from one process (|a - b| / (|b| + rms b)): master ", worst[0], ", m ",
            worst[1], ", v ", worst[2], "; parameters beyond the tolerance: ", worst_params);
}

}  // namespace

TEST_CASE("N ranks on N micro-batches equal one process on their mean gradient (bit for bit on 2 ranks)") {
  run_against_reference<model>({.exact = world_size() == 2});
}

TEST_CASE("clipping on some steps only, by one global norm across the ranks: parameters and CPU state") {
  // About half the steps clip: a wrong 1/N or clip factor changes the gradient's scale between
  // steps, which Adam does not hide (clipping every step gives every step the same norm).
  run_against_reference<model>({.clip = true, .tolerance = 1e-3f});
}

TEST_CASE("gradients whose ranks would each select other columns: the summed scores select, as one process does") {
  run_against_reference<model>({.rank_specific = true, .exact = world_size() == 2});
  run_against_reference<model>({.clip = true, .rank_specific = true, .tolerance = 1e-3f});
}

TEST_CASE("larger shapes (4x every dimension): as one process, with and without clipping") {
  using large = zenflow_test::basic_data_parallel_model<4>;
  run_against_reference<large>({.exact = world_size() == 2});
  run_against_reference<large>({.clip = true, .tolerance = 1e-3f});
}

TEST_CASE("an edit reloaded on every rank equals one process reloading it (bit for bit on 2 ranks)") {
  // Selections at steps 1 and 7, intervals of 2 from step 1: before step 3 the CPU update of steps
  // 1-2 is pending (the edit wins over it); the end of step 4 writes it back, and the update of
  // steps 3-4 (from the edited master) waits until the end of step 6.
  run_against_reference<model>({.exact = world_size() == 2}, /*edit_at=*/3, /*select_interval=*/6);
}

TEST_CASE("a parameter given a gradient on some ranks only is rejected on every rank, and the step can run again") {
  const int rank = world_rank(), ranks = world_size();
  const auto options = zenflow_test::data_parallel_test_options(0.0f);
  zenflow::mpi_communicator comm(MPI_COMM_WORLD, test_options());
  model dp_model, ref_model;
  dp_coordinator dp(comm, options);
  zenflow::host_coordinator ref(options);
  dp_model.register_with(dp);
  ref_model.register_with(ref);
  host_stream s_dp, s_ref;
  for (int t = 0; t < 4; ++t) {
    dp_model.make_gradients(t, rank, ranks);
    ref_model.make_gradients(t, -1, ranks);
    if (t == 2) {
      dp_model.submit(dp, &s_dp, /*with_w2=*/rank != 0);
      const std::string e = error_of([&] { dp.step(&s_dp, missing_gradients::skip); });
      CHECK(contains(e, "parameter 1 (w2) has a gradient on " + std::to_string(ranks - 1) + " of " +
                            std::to_string(ranks) + " ranks"));
      // Without skip, a gradient missing everywhere is rejected everywhere too.
      const std::string e2 = error_of([&] { dp.step(&s_dp); });
      CHECK(contains(e2, "no gradient was submitted for parameter 0 (w1)"));
    }
    dp_model.submit(dp, &s_dp);
    ref_model.submit(ref, &s_ref);
    dp.step(&s_dp);
    ref.step(&s_ref);
    s_dp.synchronize();
    s_ref.synchronize();
    CHECK(dp_model.bytes() == ref_model.bytes());
  }
}

TEST_CASE("ranks that registered different parameters fail on every rank at the first step") {
  const int rank = world_rank(), ranks = world_size();
  zenflow::mpi_communicator comm(MPI_COMM_WORLD, test_options());
  model m;
  dp_coordinator dp(comm, zenflow_test::data_parallel_test_options(0.0f));
  m.register_with(dp, rank == ranks - 1 ? "w1_renamed" : "w1");
  host_stream s;
  m.make_gradients(0, rank, ranks);
  m.submit(dp, &s);
  CHECK(contains(error_of([&] { dp.step(&s); }), "registered different parameters"));
}

TEST_CASE("a rank that fails makes every rank's step fail with its reason, not a timeout") {
  const int rank = world_rank(), ranks = world_size();
  zenflow::mpi_communicator comm(MPI_COMM_WORLD, test_options());
  model m;
  dp_coordinator dp(comm, zenflow_test::data_parallel_test_options(0.0f));
  m.register_with(dp);
  host_stream s;
  for (int t = 0; t < 2; ++t) {
    m.make_gradients(t, rank, ranks);
    m.submit(dp, &s);
    dp.step(&s);
    s.synchronize();
  }
  m.make_gradients(2, rank, ranks);
  m.submit(dp, &s);
  // A rank leaves a collective once its own part is done, possibly before its peers leave theirs:
  // without this barrier rank 1 could abort while a peer is still in step 1's last collective,
  // and that step (outside error_of) would fail instead. The barrier is on another communicator.
  MPI_Barrier(MPI_COMM_WORLD);
  const auto t0 = std::chrono::steady_clock::now();
  if (rank == 1) comm.abort("rank 1 ran out of memory");
  const std::string e = error_of([&] {
    dp.step(&s);
    s.synchronize();
  });
  CHECK(contains(e, "rank 1 ran out of memory"));
  CHECK(std::chrono::steady_clock::now() - t0 < 10s);  // the communicator's timeout is 20 s
  // The coordinator is failed from then on.
  CHECK(contains(error_of([&] { dp.step(&s); }), "rank 1 ran out of memory"));
}

TEST_CASE("per-rank checkpoints resume bit-identically on the same number of ranks, and only there") {
  const int rank = world_rank(), ranks = world_size();
  const auto options = zenflow_test::data_parallel_test_options(0.5f);
  const std::string path = shared_prefix() + "_rank" + std::to_string(rank) + ".ckpt";
  std::vector<std::byte> uninterrupted;
  {
    zenflow::mpi_communicator comm(MPI_COMM_WORLD, test_options());
    model m;
    dp_coordinator dp(comm, options);
    m.register_with(dp);
    host_stream s;
    for (int t = 0; t < 10; ++t) {
      if (t == 5) dp.save_checkpoint(path, &s);  // a CPU update is pending here (overlap_step)
      m.make_gradients(t, rank, ranks);
      m.submit(dp, &s, !w2_missing(t));
      dp.step(&s, missing_gradients::skip);
      s.synchronize();
    }
    dp.finish(&s);
    uninterrupted = m.bytes();
  }
  {
    zenflow::mpi_communicator comm(MPI_COMM_WORLD, test_options());
    model m;
    dp_coordinator dp(comm, options);
    m.register_with(dp);
    host_stream s;
    dp.load_checkpoint(path, &s);
    for (int t = 5; t < 10; ++t) {
      m.make_gradients(t, rank, ranks);
      m.submit(dp, &s, !w2_missing(t));
      dp.step(&s, missing_gradients::skip);
      s.synchronize();
    }
    dp.finish(&s);
    CHECK(m.bytes() == uninterrupted);
  }
  {
    // One rank alone (another number of ranks) rejects the file before changing anything.
    MPI_Comm alone;
    MPI_Comm_split(MPI_COMM_WORLD, rank, 0, &alone);
    {
      zenflow::mpi_communicator comm(alone, test_options());
      model m;
      dp_coordinator dp(comm, options);
      m.register_with(dp);
      host_stream s;
      const std::string e = error_of([&] { dp.load_checkpoint(path, &s); });
      CHECK(contains(e, "was written by rank " + std::to_string(rank) + " of " + std::to_string(ranks)));
      CHECK(dp.step_count() == 0);
    }
    MPI_Comm_free(&alone);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  std::remove(path.c_str());
}

TEST_CASE("defect: a hang when a selection is empty (a rank owns none of a parameter's CPU columns)") {
  // DeepSpeed's ZenFlow hung when a parameter's selection came out empty (its PR 8012). Here the
  // selection of parameter a is exactly rank 0's range of its columns, so rank 0 owns none of a's
  // CPU columns (its share of the reduce-scatter and of the write-back is empty), and parameter b
  // gets no gradient at any selection step, so its selection stays empty (every column on the
  // CPU). Every rank must still make every collective its peers make, and the result must be one
  // process's on the mean gradient: a rank that skipped a collective for an empty share would
  // stall its peers until the communicator's timeout (20 s) instead.
  const int rank = world_rank(), ranks = world_size();
  const zenflow::index_t rows = 6, cols = 4 * ranks;
  auto options = zenflow_test::data_parallel_test_options(0.0f);
  options.topk_ratio = 1.0f / static_cast<float>(ranks);  // k = 4: rank 0's range of a's columns
  zenflow::mpi_communicator comm(MPI_COMM_WORLD, test_options());
  dp_coordinator dp(comm, options);
  zenflow::host_coordinator ref(options);
  std::vector<float> a(rows * cols, 0.5f), b(rows * cols, -0.25f), ga(a.size()), gb(b.size());
  std::vector<float> ref_a = a, ref_b = b, ref_ga(a.size()), ref_gb(b.size());
  auto register_with = [&](auto& c, std::vector<float>& pa, std::vector<float>& pb) {
    const std::vector<float> a0 = pa, b0 = pb;
    c.register_parameter("a", zenflow::matrix_view::row_major(pa.data(), rows, cols, zenflow::dtype::f32),
                         zenflow::const_matrix_view::row_major(a0.data(), rows, cols, zenflow::dtype::f32),
                         zenflow::dtype::f32);
    c.register_parameter("b", zenflow::matrix_view::row_major(pb.data(), rows, cols, zenflow::dtype::f32),
                         zenflow::const_matrix_view::row_major(b0.data(), rows, cols, zenflow::dtype::f32),
                         zenflow::dtype::f32);
  };
  register_with(dp, a, b);
  register_with(ref, ref_a, ref_b);
  // Rank r's gradient: (r + 1) x a pattern (multiples of 1/64) whose columns 0-3 are the heaviest.
  auto fill = [&](std::vector<float>& g, int t, float factor, int salt) {
    for (zenflow::index_t r = 0; r < rows; ++r)
      for (zenflow::index_t c = 0; c < cols; ++c) {
        const int q = static_cast<int>((r * 7 + c * 3 + t * 5 + salt) % 9) - 4;
        g[r * cols + c] = factor * static_cast<float>(q + (c < 4 ? 24 : 0)) / 64;
      }
  };
  auto b_given = [&](int t) { return (t - 1) % 3 != 0; };  // never at a selection step (1, 4, 7, ...)
  host_stream s_dp, s_ref;
  bool empty_share = false;
  for (int t = 0; t < 14; ++t) {
    fill(ga, t, static_cast<float>(rank + 1), 0);
    fill(gb, t, static_cast<float>(rank + 1), 1);
    fill(ref_ga, t, static_cast<float>(ranks + 1) / 2, 0);
    fill(ref_gb, t, static_cast<float>(ranks + 1) / 2, 1);
    const auto view = [&](std::vector<float>& g) {
      return zenflow::const_matrix_view::row_major(g.data(), rows, cols, zenflow::dtype::f32);
    };
    dp.submit_gradient(0, view(ga), &s_dp);
    ref.submit_gradient(0, view(ref_ga), &s_ref);
    if (b_given(t)) {
      dp.submit_gradient(1, view(gb), &s_dp);
      ref.submit_gradient(1, view(ref_gb), &s_ref);
    }
    CAPTURE(t);
    REQUIRE_NOTHROW(dp.step(&s_dp, missing_gradients::skip));
    ref.step(&s_ref, missing_gradients::skip);
    s_dp.synchronize();
    s_ref.synchronize();
    const auto sel = dp.gpu_columns(0);
    empty_share = empty_share || (sel.size() == 4 && sel.front() == 0 && sel.back() == 3);
    CHECK(dp.gpu_columns(1).empty());
    if (ranks == 2) {
      CHECK(a == ref_a);
      CHECK(b == ref_b);
    }
  }
  dp.finish(&s_dp);
  ref.finish(&s_ref);
  CHECK(empty_share);
  for (std::size_t i = 0; i < a.size(); ++i) {
    CHECK(std::fabs(a[i] - ref_a[i]) <= 1e-3f * (1.0f + std::fabs(ref_a[i])));
    CHECK(std::fabs(b[i] - ref_b[i]) <= 1e-3f * (1.0f + std::fabs(ref_b[i])));
  }
  CHECK(dp.cpu_step_count(0) == ref.cpu_step_count(0));
  CHECK(dp.cpu_step_count(1) == ref.cpu_step_count(1));
}

TEST_CASE("moments on disk: one state file per rank in a shared directory, training as with moments in RAM") {
  const int rank = world_rank(), ranks = world_size(), steps = 10;
  // On disk under the working directory (the build tree): /tmp may be memory-backed.
  long pid = static_cast<long>(getpid());
  MPI_Bcast(&pid, 1, MPI_LONG, 0, MPI_COMM_WORLD);
  const auto dir = std::filesystem::current_path() / ("zenflow_dp_nvme_" + std::to_string(pid));
  if (rank == 0) std::filesystem::create_directory(dir);
  MPI_Barrier(MPI_COMM_WORLD);
  {
    const auto options = zenflow_test::data_parallel_test_options(0.0f);
    zenflow::coordinator_config disk_config;
    zenflow::nvme_state_config n;
    n.file.directory = dir;
    n.file.block_bytes = 4096;
    n.file.read_ahead = n.file.write_behind = 1;
    n.file.pin = zenflow::pin_policy::none;
    n.engine = {zenflow::io_engine_kind::automatic, 4};
    disk_config.nvme = n;
    zenflow::mpi_communicator comm_ram(MPI_COMM_WORLD, test_options()), comm_disk(MPI_COMM_WORLD, test_options());
    model ram_model, disk_model;
    dp_coordinator ram(comm_ram, options), disk(comm_disk, options, disk_config);
    ram_model.register_with(ram);
    disk_model.register_with(disk);
    host_stream s_ram, s_disk;
    for (int t = 0; t < steps; ++t) {
      ram_model.make_gradients(t, rank, ranks);
      disk_model.make_gradients(t, rank, ranks);
      ram_model.submit(ram, &s_ram, true);
      disk_model.submit(disk, &s_disk, true);
      ram.step(&s_ram);
      disk.step(&s_disk);
      s_ram.synchronize();
      s_disk.synchronize();
    }
    ram.finish(&s_ram);
    disk.finish(&s_disk);
    CHECK(disk_model.bytes() == ram_model.bytes());
    for (std::size_t i = 0; i < 2; ++i) {
      const auto a = zenflow_test::export_state(ram.host_optimizer(), i);
      const auto b = zenflow_test::export_state(disk.host_optimizer(), i);
      CHECK(a.exp_avg == b.exp_avg);
      CHECK(a.exp_avg_sq == b.exp_avg_sq);
      CHECK(a.master == b.master);
    }
    const auto* file = disk.host_optimizer().nvme_file();
    REQUIRE(file != nullptr);
    CHECK(file->path() == (dir / ("zenflow_state.rank" + std::to_string(rank) + ".bin")).string());
    CHECK(file->counters().bytes_written > 0);
    MPI_Barrier(MPI_COMM_WORLD);  // every rank's file exists now
    for (int r = 0; r < ranks; ++r)
      CHECK(std::filesystem::exists(dir / ("zenflow_state.rank" + std::to_string(r) + ".bin")));
    MPI_Barrier(MPI_COMM_WORLD);
  }
  MPI_Barrier(MPI_COMM_WORLD);  // every coordinator removed its file
  if (rank == 0) {
    CHECK(std::filesystem::is_empty(dir));
    std::filesystem::remove_all(dir);
  }
}

namespace {
// A CPU optimizer that sleeps before each update for as long as its rank's entry says (the ranks
// of a group whose CPU updates take different times, as on disks of different speeds).
struct rank_paced_cpu_adam : zenflow::cpu_adam {
  using zenflow::cpu_adam::cpu_adam;
  static inline std::chrono::milliseconds delay{0};
  zenflow::cpu_step_result step(std::span<const zenflow::cpu_adam_task> tasks, float grad_scale, bool check_finite) {
    std::this_thread::sleep_for(delay);
    return zenflow::cpu_adam::step(tasks, grad_scale, check_finite);
  }
};
}  // namespace

TEST_CASE("cover_cpu_update: every rank takes the longest interval any rank's CPU update needs") {
  const int rank = world_rank(), ranks = world_size(), steps = 30;
  auto options = zenflow_test::data_parallel_test_options(0.0f);
  options.update_interval = zenflow::interval_option::automatic();
  options.select_interval = zenflow::interval_option::fixed(100);
  options.max_update_interval = 24;
  options.cover_cpu_update = true;
  // The last rank's updates take 400 ms, the others' none: at ~8 ms a step it needs more steps than
  // the 24 allowed, and still more than 2 when a loaded machine makes a step take 100 ms.
  rank_paced_cpu_adam::delay = std::chrono::milliseconds(rank == ranks - 1 ? 400 : 0);
  zenflow::mpi_communicator comm(MPI_COMM_WORLD, test_options());
  model m;
  zenflow::basic_coordinator<zenflow::host_backend, rank_paced_cpu_adam, zenflow::mpi_communicator> c(comm, options);
  m.register_with(c);
  host_stream s;
  std::vector<std::int64_t> lengths;  // interval and floor at every step
  std::int64_t max_floor = 0;
  for (int t = 0; t < steps; ++t) {
    m.make_gradients(t, rank, ranks);
    std::this_thread::sleep_for(8ms);
    m.submit(c, &s, true);
    c.step(&s);
    s.synchronize();
    lengths.push_back(c.metrics().interval);
    lengths.push_back(c.metrics().interval_floor);
    max_floor = std::max(max_floor, c.metrics().interval_floor);
  }
  c.finish(&s);
  std::vector<std::byte> bytes(lengths.size() * sizeof(std::int64_t));
  std::memcpy(bytes.data(), lengths.data(), bytes.size());
  CHECK(same_on_every_rank(bytes));
  CHECK(max_floor >= 2);  // on rank 0 too, whose own updates need one step
}
