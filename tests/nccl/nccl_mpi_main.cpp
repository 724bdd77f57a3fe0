// The main of the multi-rank NCCL test: doctest under MPI (mpi_doctest.hpp), skipped (exit 77 on
// every rank) unless every rank sees at least one GPU per rank.
#define DOCTEST_CONFIG_IMPLEMENT
#include <cuda_runtime.h>

#include <string>

#include "mpi_doctest.hpp"

int main(int argc, char** argv) {
  return zenflow_test::run_doctest_under_mpi(argc, argv, [](int size) {
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess) devices = 0;
    int fewest = devices;
    MPI_Allreduce(&devices, &fewest, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    if (fewest >= size) return std::string();
    return "needs one GPU per rank: " + std::to_string(size) + " ranks, " + std::to_string(fewest) + " GPU(s) visible";
  });
}
