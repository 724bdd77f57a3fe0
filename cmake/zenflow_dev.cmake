# Development-only settings: warnings and CUDA architectures for zenflow's own tests, examples
# and benchmarks. Nothing here is exported or installed.

# zenflow's own CUDA targets build for one architecture unless told otherwise: that of the GPUs this
# machine has (nvidia-smi's compute capability), or sm_90 (H100/H200) where it has none, which
# is enough to prove the code compiles. Each extra architecture costs every .cu file another
# device compile (about a fifth of its time). The installed headers carry no architecture.
if(ZENFLOW_ENABLE_CUDA AND NOT DEFINED CACHE{ZENFLOW_CUDA_ARCHITECTURES})
  set(zenflow_arch_default 90)
  find_program(ZENFLOW_NVIDIA_SMI nvidia-smi)
  mark_as_advanced(ZENFLOW_NVIDIA_SMI)
  if(ZENFLOW_NVIDIA_SMI)
    execute_process(COMMAND "${ZENFLOW_NVIDIA_SMI}" --query-gpu=compute_cap --format=csv,noheader
                    OUTPUT_VARIABLE zenflow_caps RESULT_VARIABLE zenflow_smi_rc ERROR_QUIET)
    string(REGEX MATCHALL "[0-9]+\\.[0-9]+" zenflow_caps "${zenflow_caps}")
    if(zenflow_smi_rc EQUAL 0 AND zenflow_caps)
      string(REPLACE "." "" zenflow_caps "${zenflow_caps}")
      list(REMOVE_DUPLICATES zenflow_caps)
      set(zenflow_arch_default "${zenflow_caps}")
    endif()
  endif()
  set(ZENFLOW_CUDA_ARCHITECTURES "${zenflow_arch_default}" CACHE STRING
      "CUDA architectures for zenflow's own targets (default: this machine's GPUs, else 90)")
endif()
if(ZENFLOW_ENABLE_CUDA)
  message(STATUS "zenflow: tests, examples and benchmarks built for CUDA architectures ${ZENFLOW_CUDA_ARCHITECTURES}")
endif()

add_library(zenflow_dev INTERFACE)
target_link_libraries(zenflow_dev INTERFACE zenflow::zenflow)
# -Wrestrict stays a warning: GCC 12 reports false positives inside std::string's operator+
# (GCC bug 105651). Clang (the fuzz build) has no -Wrestrict. -Warray-bounds stays a warning from
# GCC 13 on: at -O3 it reports fmt 9's bigint buffer growth (inlined from a system header into
# every translation unit that formats a floating-point value) as an out-of-bounds memmove.
# -Wshadow too: a header-only library's warnings are its users' warnings (a vendored include
# directory is not a system one), and -Wshadow is in many trainers' own flags.
target_compile_options(zenflow_dev INTERFACE
  $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wpedantic -Wshadow -Werror -Wno-error=deprecated-declarations>
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
