// The MPI data-parallel host coordinator, instantiated once (mpi_coordinator_instance.cpp, in
// zenflow_mpi_test_main) instead of in each MPI test file that trains it.
#pragma once

#include <zenflow/coordinator.hpp>
#include <zenflow/mpi_communicator.hpp>

extern template class zenflow::basic_coordinator<zenflow::host_backend, zenflow::cpu_adam, zenflow::mpi_communicator>;
