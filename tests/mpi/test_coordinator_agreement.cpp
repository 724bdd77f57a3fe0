// The data-parallel coordinator's agreement under mpirun (2 and 3 ranks): before their first step,
// and when they load checkpoints, the ranks compare one record of fixed size (options, a
// fingerprint of the parameters and their hyper-parameters, the schedule's position, the
// selection). Ranks that registered different parameters, load checkpoints of different steps,
// or one of which could not load its file, all fail at once with the reason, before any
// collective whose size depends on what they registered, and (loading) before anything changes.
// Every case ends well within the communicator's 20 s timeout: a mismatch shows as an error, not
// as a hang.
#include <zenflow/coordinator.hpp>
#include <zenflow/mpi_communicator.hpp>

#include <doctest/doctest.h>

#include <unistd.h>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "../support/coordinator_instances.hpp"
#include "../support/data_parallel_model.hpp"
#include "../support/error_text.hpp"
#include "mpi_coordinator_instance.hpp"
#include "mpi_doctest.hpp"

using namespace std::chrono_literals;
using zenflow::host_stream;
using zenflow::missing_gradients;
using zenflow_test::contains;
using zenflow_test::error_of;
using zenflow_test::world_rank;
using zenflow_test::world_size;

namespace {

using model = zenflow_test::data_parallel_model;
using dp_coordinator = zenflow::data_parallel_host_coordinator<zenflow::mpi_communicator>;
using clock_type = std::chrono::steady_clock;

zenflow::mpi_communicator_options test_options() {
  zenflow::mpi_communicator_options o;
  o.timeout = 20s;  // a mismatch that slipped through would show as a timeout after 20 s
  return o;
}

// Rank 0's process id, the same on every rank: file names every rank agrees on.
std::string shared_prefix() {
  long pid = static_cast<long>(getpid());
  MPI_Bcast(&pid, 1, MPI_LONG, 0, MPI_COMM_WORLD);
  return "/tmp/zenflow_agree_" + std::to_string(pid);
}

void train(dp_coordinator& dp, model& m, host_stream& s, int first, int last) {
  const int rank = world_rank(), ranks = world_size();
  for (int t = first; t < last; ++t) {
    m.make_gradients(t, rank, ranks);
    m.submit(dp, &s, !zenflow_test::w2_missing(t));
    dp.step(&s, missing_gradients::skip);
    s.synchronize();
  }
}

// The first step of ranks set up by `setup(coordinator, model)` fails on every rank with `expected`
// in the message, well before the communicator's timeout.
template <class Setup>
void first_step_fails(const zenflow::zenflow_options& options, Setup&& setup, const std::string& expected) {
  const int rank = world_rank(), ranks = world_size();
  zenflow::mpi_communicator comm(MPI_COMM_WORLD, test_options());
  model m;
  dp_coordinator dp(comm, options);
  setup(dp, m);
  host_stream s;
  m.make_gradients(0, rank, ranks);
  m.submit(dp, &s);
  const auto t0 = clock_type::now();
  const std::string e = error_of([&] { dp.step(&s); });
  CAPTURE(e);
  CHECK(contains(e, expected));
  CHECK(clock_type::now() - t0 < 10s);
}

}  // namespace

TEST_CASE("ranks that registered different parameters fail at the first step, before any collective sized by them") {
  const int last = world_size() - 1;
  const auto options = zenflow_test::data_parallel_test_options(0.0f);
  SUBCASE("one more parameter on one rank") {
    // The per-step agreement on which parameters got a gradient would all-reduce 3 values on some
    // ranks and 4 on the other: the record comes first.
    std::vector<float> extra(8, 0.5f);
    first_step_fails(
        options,
        [&](dp_coordinator& dp, model& m) {
          m.register_with(dp);
          if (world_rank() == last)
            dp.register_parameter("extra", zenflow::vector_view(extra.data(), 8, zenflow::dtype::f32), extra);
        },
        "the number of parameters (3 and 4)");
  }
  SUBCASE("a different name") {
    first_step_fails(
        options, [&](dp_coordinator& dp, model& m) { m.register_with(dp, world_rank() == last ? "w1_renamed" : "w1"); },
        "registered different parameters");
  }
  SUBCASE("different betas") {  // per-group fields: every parameter's differ
    auto other = options;
    if (world_rank() == last) other.optimizer.beta2 = 0.99f;
    first_step_fails(
        other, [&](dp_coordinator& dp, model& m) { m.register_with(dp); }, "per-group hyper-parameters");
  }
  SUBCASE("a different Adam variant") {  // a field every parameter shares: the options differ
    auto other = options;
    if (world_rank() == last) other.optimizer.adamw_mode = false;
    first_step_fails(
        other, [&](dp_coordinator& dp, model& m) { m.register_with(dp); }, "their options");
  }
  // One element of one parameter: a replica that starts apart would stay apart (its 1-D
  // parameters and GPU columns are updated alike on every rank from the same mean gradient).
  const auto initial_value_differs = [&](auto&& change) {
    first_step_fails(
        options,
        [&](dp_coordinator& dp, model& m) {
          if (world_rank() == last) change(m);
          m.register_with(dp);
        },
        "registered different initial values");
  };
  SUBCASE("a different initial value: 1-D") {
    initial_value_differs([](model& m) { m.b[2] += 1.0f; });
  }
  SUBCASE("a different initial value: row-major bf16") {
    initial_value_differs([](model& m) { m.w1[30] = zenflow::to_bfloat16(2.0f); });
  }
  SUBCASE("a different initial value: column-contiguous f32") {
    initial_value_differs([](model& m) { m.w2[37] += 0.5f; });
  }
  SUBCASE("a different learning rate for one parameter") {
    first_step_fails(
        options,
        [&](dp_coordinator& dp, model& m) {
          m.register_with(dp);
          if (world_rank() == last) {
            auto adam = dp.hyper_parameters_of(1);
            adam.lr *= 2.0f;
            dp.set_hyper_parameters(1, adam);
          }
        },
        "per-group hyper-parameters (lr, beta1, beta2, eps and weight_decay)");
  }
}

TEST_CASE("checkpoints: the ranks compare what they load; all load or none does") {
  const int rank = world_rank(), ranks = world_size(), last = ranks - 1;
  const auto options = zenflow_test::data_parallel_test_options(0.5f);
  const std::string prefix = shared_prefix() + "_rank" + std::to_string(rank);
  const std::string at4 = prefix + "_step4.ckpt", at6 = prefix + "_step6.ckpt";
  std::vector<std::byte> uninterrupted;
  {
    zenflow::mpi_communicator comm(MPI_COMM_WORLD, test_options());
    model m;
    dp_coordinator dp(comm, options);
    m.register_with(dp);
    host_stream s;
    train(dp, m, s, 0, 4);
    dp.save_checkpoint(at4, &s);
    train(dp, m, s, 4, 6);
    dp.save_checkpoint(at6, &s);
    train(dp, m, s, 6, 9);
    dp.finish(&s);
    uninterrupted = m.bytes();
  }
  zenflow::mpi_communicator comm(MPI_COMM_WORLD, test_options());
  // Each case's coordinators are fresh; every failed load leaves them as constructed.
  auto load_fails = [&](const std::string& path, const std::string& expected) {
    model m;
    dp_coordinator dp(comm, options);
    m.register_with(dp);
    const auto before = m.bytes();
    host_stream s;
    const auto t0 = clock_type::now();
    const std::string e = error_of([&] { dp.load_checkpoint(path, &s); });
    CAPTURE(e);
    CHECK(contains(e, expected));
    CHECK(clock_type::now() - t0 < 10s);
    CHECK(dp.step_count() == 0);
    CHECK(m.bytes() == before);
  };
  SUBCASE("checkpoints of different steps") {
    load_fails(rank == 0 ? at4 : at6, "the ranks' checkpoints are not from one save: rank 0 and rank 1 of " +
                                          std::to_string(ranks) + " differ in step (4 and 6)");
  }
  SUBCASE("one rank whose file cannot be loaded") {
    const std::string broken = prefix + "_broken.ckpt";
    if (rank == last) std::ofstream(broken) << "not a checkpoint";
    load_fails(rank == last ? broken : at6, "rank " + std::to_string(last) + " of " + std::to_string(ranks) +
                                                " could not load its checkpoint, so no rank loaded one: zenflow: ");
    std::remove(broken.c_str());
  }
  SUBCASE("one rank whose file is corrupted: its peers hear that reason, not the field it broke") {
    // The first payload byte is the offload mode: flipped, the options would mismatch first.
    const std::string corrupted = prefix + "_corrupted.ckpt";
    if (rank == last) {
      std::filesystem::copy_file(at6, corrupted, std::filesystem::copy_options::overwrite_existing);
      std::fstream f(corrupted, std::ios::in | std::ios::out | std::ios::binary);
      f.seekg(32);
      const char byte = static_cast<char>(f.get() ^ 0x01);
      f.seekp(32);
      f.put(byte);
    }
    load_fails(rank == last ? corrupted : at6,
               "rank " + std::to_string(last) + " of " + std::to_string(ranks) +
                   " could not load its checkpoint, so no rank loaded one: zenflow: checkpoint: '" + shared_prefix() +
                   "_rank" + std::to_string(last) + "_corrupted.ckpt' is corrupted (checksum mismatch)");
    std::remove(corrupted.c_str());
  }
  SUBCASE("one rank that loads while the others take their first step") {
    model m;
    dp_coordinator dp(comm, options);
    m.register_with(dp);
    host_stream s;
    const auto t0 = clock_type::now();
    std::string e;
    if (rank == 0) {
      e = error_of([&] { dp.load_checkpoint(at6, &s); });
    } else {
      m.make_gradients(0, rank, ranks);
      m.submit(dp, &s);
      e = error_of([&] { dp.step(&s); });
    }
    CAPTURE(e);
    CHECK(contains(e, "rank 0 loads a checkpoint while rank 1 takes its first step"));
    CHECK(clock_type::now() - t0 < 10s);
  }
  SUBCASE("the same save on every rank resumes as if uninterrupted, after a failed attempt") {
    model m;
    dp_coordinator dp(comm, options);
    m.register_with(dp);
    host_stream s;
    CHECK(!error_of([&] { dp.load_checkpoint(rank == 0 ? at4 : at6, &s); }).empty());
    dp.load_checkpoint(at6, &s);
    CHECK(dp.step_count() == 6);
    train(dp, m, s, 6, 9);
    dp.finish(&s);
    CHECK(m.bytes() == uninterrupted);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  std::remove(at4.c_str());
  std::remove(at6.c_str());
}
