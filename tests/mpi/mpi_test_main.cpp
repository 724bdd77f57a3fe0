// The main of the MPI test executables: doctest on every rank (mpi_doctest.hpp).
#define DOCTEST_CONFIG_IMPLEMENT
#include "mpi_doctest.hpp"

int main(int argc, char** argv) {
  return zenflow_test::run_doctest_under_mpi(argc, argv, [](int) { return std::string(); });
}
