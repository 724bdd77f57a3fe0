// The explicit instantiation that mpi_coordinator_instance.hpp declares.
#include "mpi_coordinator_instance.hpp"

template class zenflow::basic_coordinator<zenflow::host_backend, zenflow::cpu_adam, zenflow::mpi_communicator>;
