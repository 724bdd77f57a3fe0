# Development-only settings: warnings and CUDA architectures for zenflow's own tests, examples
# and benchmarks. Nothing here is exported or installed.

set(ZENFLOW_CUDA_ARCHITECTURES "80;90" CACHE STRING "CUDA architectures for zenflow's own targets")

add_library(zenflow_dev INTERFACE)
target_link_libraries(zenflow_dev INTERFACE zenflow::zenflow)
# -Wrestrict stays a warning: GCC 12 reports false positives inside std::string's operator+
# (GCC bug 105651). Clang (the fuzz build) has no -Wrestrict. -Warray-bounds stays a warning from
# GCC 13 on: at -O3 it reports fmt 9's bigint buffer growth (inlined from a system header into
# every translation unit that formats a floating-point value) as an out-of-bounds memmove.
target_compile_options(zenflow_dev INTERFACE
  $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wpedantic -Werror -Wno-error=deprecated-declarations>
  $<$<COMPILE_LANG_AND_ID:CXX,GNU>:-Wno-error=restrict>
  $<$<AND:$<COMPILE_LANG_AND_ID:CXX,GNU>,$<VERSION_GREATER_EQUAL:$<CXX_COMPILER_VERSION>,13>>:-Wno-error=array-bounds>
  $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra --expt-relaxed-constexpr -Xcudafe=--display_error_number>)
if(ZENFLOW_ENABLE_CUDA)
  # fmt 9 under nvcc in C++20 needs this (fmt's constexpr detection fails there); harmless elsewhere.
  target_compile_definitions(zenflow_dev INTERFACE $<$<COMPILE_LANGUAGE:CUDA>:FMT_USE_CONSTEXPR=1>)
endif()

# zenflow_setup_target(<target>): the settings every own target gets.
function(zenflow_setup_target target)
  target_link_libraries(${target} PRIVATE zenflow_dev)
  if(ZENFLOW_ENABLE_CUDA)
    set_target_properties(${target} PROPERTIES CUDA_ARCHITECTURES "${ZENFLOW_CUDA_ARCHITECTURES}")
  endif()
endfunction()
