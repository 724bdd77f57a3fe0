// Umbrella header: every host-compilable (.hpp) public header of zenflow.
#pragma once

#include "zenflow/adam_math.hpp"
#include "zenflow/concepts.hpp"
#include "zenflow/config.hpp"
#include "zenflow/error.hpp"
#include "zenflow/importance_selector.hpp"
#include "zenflow/options.hpp"
#include "zenflow/types.hpp"
#include "zenflow/version.hpp"
#include "zenflow/view.hpp"
