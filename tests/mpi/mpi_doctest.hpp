// doctest under MPI: every rank runs the same test cases in the same order (collectives meet),
// rank 0 reports in full and the others only their failures, and every rank exits with the worst
// verdict of all ranks, so mpirun's exit status is the test's.
#pragma once

#include <mpi.h>

#include <doctest/doctest.h>

#include <cstddef>
#include <cstdio>
#include <string>
#include <vector>

namespace zenflow_test {

inline int world_rank() {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return rank;
}
inline int world_size() {
  int size = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  return size;
}

/// True on every rank when every rank's `local` bytes equal rank 0's. Collective.
inline bool same_on_every_rank(const std::vector<std::byte>& local) {
  std::vector<std::byte> root = local;
  MPI_Bcast(root.data(), static_cast<int>(root.size()), MPI_BYTE, 0, MPI_COMM_WORLD);
  int same = root == local ? 1 : 0, all = 0;
  MPI_Allreduce(&same, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  return all == 1;
}

/// MPI_Init_thread(MPI_THREAD_MULTIPLE), doctest, the worst exit code of all ranks, MPI_Finalize.
/// `skip(size)` may return a reason to skip the whole executable: every rank then exits with 77
/// (ctest's SKIP_RETURN_CODE) after rank 0 printed the reason.
template <class Skip>
int run_doctest_under_mpi(int argc, char** argv, Skip&& skip) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  const int rank = world_rank();
  int code = 0;
  if (provided != MPI_THREAD_MULTIPLE) {
    std::fprintf(stderr, "rank %d: MPI does not provide MPI_THREAD_MULTIPLE (got %d)\n", rank, provided);
    code = 1;
  } else if (const std::string reason = skip(world_size()); !reason.empty()) {
    if (rank == 0) std::printf("skipped: %s\n", reason.c_str());
    code = 77;
  } else {
    doctest::Context context(argc, argv);
    if (rank != 0) context.setOption("minimal", true);
    code = context.run();
    if (context.shouldExit()) code = 0;
  }
  int worst = code;
  MPI_Allreduce(&code, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return worst;
}

}  // namespace zenflow_test
