// zenflow: the library's version, defined in exactly one place.
// CMake reads ZENFLOW_VERSION_{MAJOR,MINOR,PATCH} from this file.
#pragma once

#define ZENFLOW_VERSION_MAJOR 0
#define ZENFLOW_VERSION_MINOR 1
#define ZENFLOW_VERSION_PATCH 0

/// One integer that orders releases: MAJOR * 10000 + MINOR * 100 + PATCH.
#define ZENFLOW_VERSION (ZENFLOW_VERSION_MAJOR * 10000 + ZENFLOW_VERSION_MINOR * 100 + ZENFLOW_VERSION_PATCH)

namespace zenflow {
inline constexpr int version_major = ZENFLOW_VERSION_MAJOR;
inline constexpr int version_minor = ZENFLOW_VERSION_MINOR;
inline constexpr int version_patch = ZENFLOW_VERSION_PATCH;
}  // namespace zenflow
