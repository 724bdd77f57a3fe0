// Umbrella header: every host-compilable (.hpp) public header of zenflow (mpi_communicator.hpp
// needs MPI and zenflow::mpi: include it on its own).
#pragma once

#include "zenflow/adam_math.hpp"
#include "zenflow/communicator.hpp"
#include "zenflow/concepts.hpp"
#include "zenflow/config.hpp"
#include "zenflow/coordinator.hpp"
#include "zenflow/cpu_adam.hpp"
#include "zenflow/error.hpp"
#include "zenflow/gradient_stats.hpp"
#include "zenflow/host_stream.hpp"
#include "zenflow/importance_selector.hpp"
#include "zenflow/options.hpp"
#include "zenflow/sparse_adam.hpp"
#include "zenflow/thread_pool.hpp"
#include "zenflow/transfer_queue.hpp"
#include "zenflow/types.hpp"
#include "zenflow/version.hpp"
#include "zenflow/view.hpp"
