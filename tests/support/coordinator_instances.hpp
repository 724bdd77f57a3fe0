// The host coordinators most tests train, instantiated once per build (coordinator_instances.cpp,
// linked into every unit test) instead of once in every test file that includes this header.
// A coordinator is a few thousand lines of templates: compiled in each of a dozen test files, it
// was most of the test build's time, and three times more under the sanitizers.
#pragma once

#include <zenflow/communicator.hpp>
#include <zenflow/coordinator.hpp>

extern template class zenflow::basic_coordinator<zenflow::host_backend>;
extern template class zenflow::basic_coordinator<zenflow::host_backend, zenflow::cpu_adam, zenflow::self_communicator>;
