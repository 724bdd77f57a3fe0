// make_io_engine: the engine a configuration asks for, with the reason for a fallback. Its
// definition depends on whether the translation unit has io_uring (ZENFLOW_WITH_URING), so it
// lives in an inline namespace named after that choice: a program whose translation units differ
// gets two functions, never one function with two definitions. Included by io_engine.hpp.
#pragma once

#include <string>

namespace zenflow {

#if defined(ZENFLOW_WITH_URING) && ZENFLOW_WITH_URING
#define ZENFLOW_IO_URING_BUILT_IN true
inline namespace with_io_uring {
#else
#define ZENFLOW_IO_URING_BUILT_IN false
inline namespace without_io_uring {
#endif

/// True when this translation unit was built with zenflow::uring (ZENFLOW_WITH_URING).
inline constexpr bool io_uring_built_in = ZENFLOW_IO_URING_BUILT_IN;

/// Builds the engine `config` asks for (see io_engine_kind). Throws `zenflow::error` naming
/// `kind` when io_uring is asked for and cannot run here (with the reason), or `queue_depth` /
/// `threads` when they are out of range.
inline any_io_engine make_io_engine(const io_engine_config& config = {}) {
  expects(config.kind == io_engine_kind::automatic || config.kind == io_engine_kind::uring ||
              config.kind == io_engine_kind::posix,
          "kind", "must be automatic, uring or posix, got ", static_cast<int>(config.kind));
  if (config.kind == io_engine_kind::posix)
    return any_io_engine(posix_io_engine(config.queue_depth, config.threads), "chosen by io_engine_kind::posix");
#if defined(ZENFLOW_WITH_URING) && ZENFLOW_WITH_URING
  std::string why;
  try {
    return any_io_engine(uring_io_engine(config.queue_depth));
  } catch (const error& e) {
    if (config.kind == io_engine_kind::uring || e.argument() != "io_uring")
      throw error(config.kind == io_engine_kind::uring && e.argument() == "io_uring" ? "kind" : e.argument(),
                  config.kind == io_engine_kind::uring && e.argument() == "io_uring"
                      ? "io_engine_kind::uring, but io_uring cannot run here: " + e.reason()
                      : e.reason());
    why = e.reason();
  }
  return any_io_engine(posix_io_engine(config.queue_depth, config.threads), "io_uring unavailable: " + why);
#else
  expects(config.kind != io_engine_kind::uring, "kind",
          "io_engine_kind::uring, but this program was built without io_uring: link zenflow::uring (liburing)");
  return any_io_engine(posix_io_engine(config.queue_depth, config.threads),
                       "io_uring not built in (link zenflow::uring)");
#endif
}

}  // namespace with_io_uring / without_io_uring
#undef ZENFLOW_IO_URING_BUILT_IN

}  // namespace zenflow
