// ZENFLOW_TEST_FILE_ID: the namespace that holds one test file's names.
//
// The unit tests are compiled as a unity build (tests/CMakeLists.txt): several test files share a
// translation unit, so two files' helpers of the same name, even in unnamed namespaces, would
// collide. Each file therefore puts everything after its includes in
// `namespace ZENFLOW_TEST_FILE_ID { ... }`, which CMake defines to a different name for every
// file of a unity build (the target's UNITY_BUILD_UNIQUE_ID). A file compiled alone (an editor
// reading it through compile_commands.json, for one) gets this fallback.
#pragma once

#ifndef ZENFLOW_TEST_FILE_ID
#define ZENFLOW_TEST_FILE_ID zenflow_test_file
#endif
