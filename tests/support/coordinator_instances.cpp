// The explicit instantiations that tests/support/coordinator_instances.hpp declares.
#include "coordinator_instances.hpp"

template class zenflow::basic_coordinator<zenflow::host_backend>;
template class zenflow::basic_coordinator<zenflow::testing::staged_host_backend>;
