"""Smoke test of bench/torch/bench_transformer_step.py: the tiny preset on the CPU, every
ZenFlowAdamW mode and torch.optim.AdamW for a few steps; checks the result's fields. And the
MiniLM fine-tune's refusals before it trains (a model folder without a model, a GPU run without
a GPU), and bench/torch/bench_checkpoint_memory.py's bound on what a state_dict() costs."""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "torch" / "bench_transformer_step.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_transformer_step", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def finite(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def test_tiny_cpu_preset(tmp_path):
    bench = load_bench()
    out_path = tmp_path / "bench.json"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # on a loaded 2-core machine torch's 2 threads made these steps ~50x slower
    try:
        out = bench.run(["--device", "cpu", "--preset", "tiny", "--batch", "2", "--seq", "16", "--warmup", "1",
                         "--steps", "3", "--update-interval", "2", "--cpu-threads", "1", "--quiet",
                         "--modes", "torch_adamw,zero_offload,zenflow_async,zenflow_sync,deepspeed_zenflow",
                         "--out", str(out_path)])
    finally:
        torch.set_num_threads(threads)
    assert json.loads(out_path.read_text())["results"].keys() == out["results"].keys()
    results = out["results"]
    assert set(results) == {"torch_adamw", "zero_offload", "zenflow_async", "zenflow_sync"}
    assert "deepspeed_zenflow" in out["skipped"]  # never run on the CPU
    for name, r in results.items():
        for key in ("step_ms_median", "step_ms_mean", "step_ms_min", "step_ms_max", "wall_ms_per_step",
                    "ratio_to_dense", "loss_last"):
            assert finite(r[key]), (name, key, r[key])
        assert r["step_ms_mean"] > 0
        assert r["peak_gpu_memory_bytes"] is None  # CPU run
    assert results["torch_adamw"]["ratio_to_dense"] == 1.0
    for name in ("zero_offload", "zenflow_async", "zenflow_sync"):
        r = results[name]
        for key in ("stall_ms_per_step", "cpu_update_ms_per_step", "bytes_d2h_per_step", "bytes_h2d_per_step",
                    "pcie_bytes_per_step"):
            assert finite(r[key]) and r[key] >= 0, (name, key, r[key])
        assert r["bytes_d2h_per_step"] > 0  # the offloaded columns' gradients
    for b in out["bars"].values():
        assert b["verdict"] == "not judged on CPU"
        assert finite(b["value"]) or b["value"] is None


def test_profile_reports_where_a_step_spends_its_time():
    bench = load_bench()
    reserved = 1 if len(os.sched_getaffinity(0)) > 1 else 0
    out = bench.run(["--device", "cpu", "--preset", "tiny", "--batch", "2", "--seq", "16", "--warmup", "1",
                     "--steps", "2", "--update-interval", "2", "--cpu-threads", "1", "--quiet",
                     "--modes", "torch_adamw,zenflow_async", "--profile", "2", "--reserved-cpus", str(reserved)])
    assert out["results"]["zenflow_async"]["options"]["reserved_cpus"] == reserved
    for name, r in out["results"].items():
        prof = r["profile"]
        assert prof["steps"] == 2
        assert prof["top_device"] == []  # a CPU run has no device time
        rows = prof["top_cpu"]
        assert rows and all(finite(x["self_cpu_ms"]) and x["self_cpu_ms"] >= 0 for x in rows), (name, rows)
        assert rows == sorted(rows, key=lambda x: -x["self_cpu_ms"])
        assert 0 < rows[0]["self_cpu_ms"] <= prof["self_cpu_ms_total"]
        assert any("aten::" in x["name"] for x in rows), (name, [x["name"] for x in rows])
    with pytest.raises(SystemExit):
        bench.run(["--device", "cpu", "--profile", "-1", "--quiet"])


FINETUNE = Path(__file__).resolve().parents[2] / "examples" / "torch_finetune" / "finetune_minilm.py"


def test_finetune_minilm_names_what_it_cannot_run_on(tmp_path):
    def fails(*args):
        r = subprocess.run([sys.executable, str(FINETUNE), *args, "--out", str(tmp_path / "x.csv")],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 2, r.stdout + r.stderr
        assert not (tmp_path / "x.csv").exists()  # refused before training
        return r.stderr
    assert "--model-dir: " + repr(str(tmp_path)) + " holds no config.json" in fails("--model-dir", str(tmp_path))
    if not torch.cuda.is_available():
        assert "--device cuda: torch sees no CUDA device" in fails("--device", "cuda")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_state_dict_costs_one_copy_of_the_state():
    # bench/torch/bench_checkpoint_memory.py on 64 MB of state per mode. state_dict() returns the
    # state as one tensor: its peak above the process's memory before the call is that tensor and
    # little more (it was twice the checkpoint while the file was read into bytes, then copied).
    spec = importlib.util.spec_from_file_location("bench_checkpoint_memory",
                                                  SCRIPT.parent / "bench_checkpoint_memory.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = bench.run(["--tensors", "2", "--rows", "1024", "--cols", "4096", "--steps", "3", "--quiet"])
    assert set(out["results"]) == {"dense", "zero_offload", "zenflow_async"}
    for name, r in out["results"].items():
        assert r["checkpoint_bytes"] >= 2 * 1024 * 4096 * 8, name  # the moments at least
        assert r["save_peak_over_checkpoint"] < 1.4, (name, r)
        assert r["load_peak_bytes"] > 0 and r["save_seconds"] > 0 and r["load_seconds"] > 0, (name, r)
