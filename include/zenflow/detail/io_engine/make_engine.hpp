// make_io_engine: the engine a configuration asks for, with the reason for a fallback.
//
// Whether io_uring exists is a property of the program, not of the translation unit: a unit built
// with zenflow::uring (ZENFLOW_WITH_URING) registers the io_uring engine's factory when the program
// starts, and make_io_engine, one definition in every unit, asks for it at run time. So the units of
// one program may differ (a library that links zenflow::core, a trainer that links zenflow::uring):
// every one of them, and every inline function that builds an engine (state_file, cpu_adam's state
// on disk), gets io_uring when any unit brought it. Included by io_engine.hpp.
#pragma once

#include <atomic>
#include <cstddef>
#include <string>

namespace zenflow {

namespace detail {
/// Builds an io_uring engine of `queue_depth` entries (throws as uring_io_engine's constructor).
using uring_engine_factory = any_io_engine (*)(std::size_t queue_depth);
/// The io_uring factory of the program: null until a unit built with zenflow::uring has started.
inline std::atomic<uring_engine_factory> registered_uring_factory{nullptr};
}  // namespace detail

#if defined(ZENFLOW_WITH_URING) && ZENFLOW_WITH_URING
#define ZENFLOW_IO_URING_BUILT_IN true
namespace detail {
inline any_io_engine make_uring_engine(std::size_t queue_depth) { return any_io_engine(uring_io_engine(queue_depth)); }
/// Registers the factory during the program's static initialization (a function called before
/// main, from another unit's static initializer, may not see it yet).
inline const bool uring_factory_registered = (registered_uring_factory.store(&make_uring_engine), true);
}  // namespace detail
inline namespace with_io_uring {
#else
#define ZENFLOW_IO_URING_BUILT_IN false
inline namespace without_io_uring {
#endif

/// True when this translation unit was built with zenflow::uring (ZENFLOW_WITH_URING). The program
/// has io_uring when any of its units was: io_uring_linked().
inline constexpr bool io_uring_built_in = ZENFLOW_IO_URING_BUILT_IN;

}  // namespace with_io_uring / without_io_uring
#undef ZENFLOW_IO_URING_BUILT_IN

/// True when a translation unit of this program was built with zenflow::uring (its engine is then
/// available to every unit, whether io_uring can run on this machine or not).
inline bool io_uring_linked() noexcept { return detail::registered_uring_factory.load() != nullptr; }

/// Builds the engine `config` asks for (see io_engine_kind). Throws `zenflow::error` naming
/// `kind` when io_uring is asked for and cannot run here (with the reason) or no unit of the
/// program was built with zenflow::uring, or `queue_depth` / `threads` when they are out of range.
inline any_io_engine make_io_engine(const io_engine_config& config = {}) {
  expects(config.kind == io_engine_kind::automatic || config.kind == io_engine_kind::uring ||
              config.kind == io_engine_kind::posix,
          "kind", "must be automatic, uring or posix, got ", static_cast<int>(config.kind));
  if (config.kind == io_engine_kind::posix)
    return any_io_engine(posix_io_engine(config.queue_depth, config.threads), "chosen by io_engine_kind::posix");
  const detail::uring_engine_factory uring = detail::registered_uring_factory.load();
  if (uring == nullptr) {
    expects(config.kind != io_engine_kind::uring, "kind",
            "io_engine_kind::uring, but this program was built without io_uring: link zenflow::uring (liburing)");
    return any_io_engine(posix_io_engine(config.queue_depth, config.threads),
                         "io_uring not built in (link zenflow::uring)");
  }
  std::string why;
  try {
    return uring(config.queue_depth);
  } catch (const error& e) {
    if (config.kind == io_engine_kind::uring || e.argument() != "io_uring")
      throw error(config.kind == io_engine_kind::uring && e.argument() == "io_uring" ? "kind" : e.argument(),
                  config.kind == io_engine_kind::uring && e.argument() == "io_uring"
                      ? "io_engine_kind::uring, but io_uring cannot run here: " + e.reason()
                      : e.reason());
    why = e.reason();
  }
  return any_io_engine(posix_io_engine(config.queue_depth, config.threads), "io_uring unavailable: " + why);
}

}  // namespace zenflow
