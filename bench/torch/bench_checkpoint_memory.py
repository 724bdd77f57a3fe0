"""What saving and loading ZenFlowAdamW's state costs in host memory and time (CPU tensors).

For each mode: --tensors fp32 parameters of --rows x --cols, one step() with random gradients
(ZenFlow: --steps of them, so that an interval is open and a CPU result pending), then

  - state_dict(): the peak resident memory above what the process held before the call
    (VmHWM after /proc/self/clear_refs resets it: anonymous memory and the file pages it maps),
    the peak of its anonymous memory alone (RssAnon, sampled every 2 ms: a shorter spike may be
    missed), its seconds, and the checkpoint's size;
  - load_state_dict() of that state dict into the same optimizer: the same figures.

Peaks are reported in MB and as a multiple of the checkpoint's size. The state dict's tensor maps
a file, so reading it (torch.save, load_state_dict) adds file pages, which the kernel reclaims
under pressure, not anonymous memory. Loading keeps the current state until the loaded one is
in place (a rejected load changes nothing). With --nvme DIR the optimizer keeps its master and
moments in a state file in DIR (the NVMe tier), and both calls stage their file there. Linux only
(/proc).

    python bench/torch/bench_checkpoint_memory.py [--tensors 8] [--rows 4096] [--cols 4096]
        [--modes dense,zero_offload,zenflow_async] [--nvme DIR] [--json out.json]
"""

import argparse
import gc
import json
import sys
import threading
import time

import torch
from torch import nn


def _status(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident size


def measure(fn):
    """(result, peak resident bytes above the start, peak anonymous bytes above the start,
    seconds) of fn()."""
    gc.collect()
    _reset_peak()
    start, anon_start = _status("VmRSS"), _status("RssAnon")
    anon_peak, done = [anon_start], threading.Event()

    def sample():
        while not done.is_set():
            anon_peak[0] = max(anon_peak[0], _status("RssAnon"))
            done.wait(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t = time.perf_counter()
    try:
        result = fn()
    finally:
        seconds = time.perf_counter() - t
        done.set()
        sampler.join()
    anon_peak[0] = max(anon_peak[0], _status("RssAnon"))
    return result, _status("VmHWM") - start, anon_peak[0] - anon_start, seconds


MODES = {
    "dense": dict(mode="dense"),
    "zero_offload": dict(mode="zero_offload"),
    "zenflow_async": dict(mode="zenflow", overlap_step=True, topk_ratio=0.1, update_interval=4),
}


def run(argv=None):
    from zenflow.torch import ZenFlowAdamW
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tensors", type=int, default=8)
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--cols", type=int, default=4096)
    p.add_argument("--steps", type=int, default=6, help="steps before saving (ZenFlow: mid-interval)")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--nvme", metavar="DIR", help="the optimizer's state in a state file in DIR (default: in RAM)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    results = {}
    for name in args.modes.split(","):
        torch.manual_seed(0)
        params = [nn.Parameter(torch.randn(args.rows, args.cols)) for _ in range(args.tensors)]
        nvme = dict(offload_optimizer={"device": "nvme", "nvme_path": args.nvme}) if args.nvme else {}
        opt = ZenFlowAdamW(params, lr=1e-3, cpu_threads=0, **MODES[name], **nvme)
        for _ in range(args.steps):
            for q in params:
                q.grad = torch.randn_like(q)
            opt.step()
        state, save_peak, save_anon, save_s = measure(opt.state_dict)
        size = state["zenflow"]["checkpoint"].numel()
        _, load_peak, load_anon, load_s = measure(lambda: opt.load_state_dict(state))
        opt.close()
        del opt, state, params
        results[name] = {"checkpoint_bytes": size, "save_peak_bytes": save_peak, "save_anon_peak_bytes": save_anon,
                         "save_seconds": save_s, "load_peak_bytes": load_peak, "load_anon_peak_bytes": load_anon,
                         "load_seconds": load_s, "save_peak_over_checkpoint": save_peak / size,
                         "load_peak_over_checkpoint": load_peak / size}
        if not args.quiet:
            print(f"{name:14s} checkpoint {size / 1e6:8.1f} MB | state_dict peak +{save_peak / size:.2f}x "
                  f"(anonymous +{save_anon / size:.2f}x) {save_s:6.2f} s | load_state_dict peak "
                  f"+{load_peak / size:.2f}x (anonymous +{load_anon / size:.2f}x) {load_s:6.2f} s", flush=True)
    out = {"config": vars(args), "results": results}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    run(sys.argv[1:])
