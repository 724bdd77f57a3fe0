// The four set-ups the end-to-end benchmarks compare (host and CUDA versions share them).
#pragma once

#include <zenflow/options.hpp>

#include <map>

namespace zenflow_bench {

enum end_to_end_mode : int { dense = 0, zero_offload = 1, zenflow_sync = 2, zenflow_async = 3 };

/// dense (no offload: the roofline), ZeRO-Offload, and ZenFlow (topk 0.1, update_interval 4)
/// without and with the overlapped CPU update.
inline zenflow::zenflow_options mode_options(int mode, float lr) {
  zenflow::zenflow_options o;
  if (mode == dense) {
    o = zenflow::zenflow_options::dense();
  } else if (mode == zero_offload) {
    o = zenflow::zenflow_options::zero_offload();
  } else {
    o.topk_ratio = 0.1f;
    o.update_interval = zenflow::interval_option::fixed(4);
    o.select_interval = zenflow::interval_option::fixed(100);
    o.overlap_step = mode == zenflow_async;
  }
  o.optimizer.lr = lr;
  return o;
}

inline const char* mode_name(int mode) {
  static const char* names[] = {"dense", "zero_offload", "zenflow_sync", "zenflow_async"};
  return names[mode];
}

/// Seconds per step of each mode measured so far in this run (dense runs first).
inline std::map<int, double>& step_seconds() {
  static std::map<int, double> seconds;
  return seconds;
}

/// Seconds per step the trainer waited on CPU-side work, per mode measured so far.
inline std::map<int, double>& stall_seconds() {
  static std::map<int, double> seconds;
  return seconds;
}

}  // namespace zenflow_bench
