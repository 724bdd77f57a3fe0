// The explicit instantiations that tests/support/coordinator_instances.hpp declares (a second
// file, so that a parallel build compiles the two at once).
#include "coordinator_instances.hpp"

template class zenflow::basic_coordinator<zenflow::host_backend, zenflow::cpu_adam, zenflow::self_communicator>;
