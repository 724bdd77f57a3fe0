"""The NVMe state tier from zenflow.torch: the CPU columns' state (moments, and the fp32 master
unless master_on_disk is False) in a state file on disk
(``offload_optimizer={"device": "nvme", "nvme_path": ...}`` or DeepSpeed's offload_optimizer and
aio blocks) train bit-identically to moments in RAM (our loop and transformers.Trainer), report
their disk traffic, checkpoint interchangeably with RAM state, and every DeepSpeed key is
honoured or rejected with its reason."""

import importlib.util
import os
import re
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

import pytest
import torch

from conftest import make_model, train_step
from reference import Dataset, model
from zenflow.torch import ZenFlowAdamW, deepspeed_options, nvme_config

ASYNC = dict(topk_ratio=0.25, update_interval=2, select_interval=3)


@pytest.fixture
def state_dir():
    """A directory on a disk file system (state files refuse tmpfs): under $ZENFLOW_TEST_STATE_DIR,
    else under the working directory's build/ (the README's commands run from the repository)."""
    base = os.environ.get("ZENFLOW_TEST_STATE_DIR") or os.path.join(os.getcwd(), "build")
    os.makedirs(base, exist_ok=True)
    d = tempfile.mkdtemp(prefix="zenflow_nvme_test.", dir=base)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def mounted_as(path, types):
    """Whether `path` is a mount point of one of the file system `types` (/proc/mounts)."""
    try:
        with open("/proc/mounts") as f:
            return any(len(x) > 2 and x[1] == path and x[2] in types for x in (line.split() for line in f))
    except OSError:
        return False


def nvme(path, **more):
    # Small blocks: the tiny model's tensors span several, and columns share them.
    return dict(offload_optimizer={"device": "nvme", "nvme_path": path, **more}, aio={"block_size": 4096})


def run(steps, **options):
    m = make_model()
    opt = ZenFlowAdamW(m.parameters(), lr=1e-2, **options)
    for s in range(steps):
        train_step(m, opt, s)
    opt.flush()
    return m, opt


@pytest.mark.parametrize("cpu_state", ["fp32", "bf16_moments", "blockwise8_moments"])
@pytest.mark.parametrize("master_on_disk", [True, False])
@pytest.mark.parametrize("mode", ["zenflow", "zero_offload"])
def test_state_on_disk_trains_bit_identically(state_dir, mode, master_on_disk, cpu_state):
    extra = dict(ASYNC if mode == "zenflow" else {}, cpu_state=cpu_state)
    ram_model, ram = run(10, mode=mode, **extra)
    disk_model, disk = run(10, mode=mode, **extra, **nvme(state_dir, master_on_disk=master_on_disk))
    for a, b in zip(ram_model.parameters(), disk_model.parameters()):
        assert torch.equal(a, b)
    # The whole optimizer state (moments, masters, step counts, the pending interval), as saved.
    assert torch.equal(ram.state_dict()["zenflow"]["checkpoint"], disk.state_dict()["zenflow"]["checkpoint"])
    status = disk.nvme_status
    assert state_dir in status and "engine" in status and "pool" in status
    assert ram.nvme_status == "" and ram.nvme is None
    assert disk.nvme["block_bytes"] == 4096 and disk.nvme["master_on_disk"] == master_on_disk
    m = disk.metrics()
    assert m["cpu_update_disk_read_bytes"] > 0 and m["cpu_update_disk_written_bytes"] > 0
    assert ram.metrics()["cpu_update_disk_read_bytes"] == 0
    files = os.listdir(state_dir)
    assert len(files) == 1 and re.fullmatch(r"zenflow_state\.\d+\.\d+\.rank0\.bin", files[0]), files
    ram.close()
    disk.close()
    assert os.listdir(state_dir) == []  # the state file is scratch: removed with the optimizer


def mapped_checkpoints(directory):
    """The removed checkpoint files under `directory` this process maps (/proc/self/maps)."""
    with open("/proc/self/maps") as f:
        return [line.split(None, 5)[-1].strip() for line in f
                if directory in line and "checkpoint.zf (deleted)" in line]


def test_checkpoints_move_between_disk_and_ram(state_dir):
    _, disk = run(6, **ASYNC, **nvme(state_dir))
    saved = disk.state_dict()
    # The state dict's tensor maps the checkpoint file, written on the SSD beside the state (not
    # in RAM, nor in a /tmp that may be RAM) and removed at once: its space goes with the tensor.
    assert len(mapped_checkpoints(state_dir)) == 1, mapped_checkpoints(state_dir)
    assert len(os.listdir(state_dir)) == 1  # the state file only
    disk.close()
    # The disk optimizer's checkpoint resumes in RAM and on disk alike, bit for bit.
    results = []
    for options in ({}, nvme(state_dir)):
        m = make_model()
        opt = ZenFlowAdamW(m.parameters(), lr=1e-2, **ASYNC, **options)
        train_step(m, opt, 0)  # builds the optimizer; the checkpoint then replaces its state
        opt.load_state_dict(saved)
        for s in range(6, 10):
            train_step(m, opt, s)
        opt.flush()
        results.append([p.detach().clone() for p in m.parameters()])
        opt.close()
    for a, b in zip(*results):
        assert torch.equal(a, b)
    del saved
    assert mapped_checkpoints(state_dir) == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_loading_a_checkpoint_holds_no_copy_of_the_state_in_ram(state_dir, monkeypatch):
    # bench/torch/bench_checkpoint_memory.py with the state on disk (ZeRO-Offload, 64 MB of
    # moments in 4 parameters). The loader validates the file, then applies it a part of a
    # parameter at a time: what it adds to the process's anonymous memory is the new optimizer's
    # own buffers (its accumulator) and a parameter's worth of reading, 0.5x of the checkpoint
    # here. When it read the whole file into memory and parsed it into a second copy, 1.6x.
    spec = importlib.util.spec_from_file_location(
        "bench_checkpoint_memory", Path(__file__).resolve().parents[2] / "bench" / "torch" / "bench_checkpoint_memory.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    staged = []  # where state_dict() and load_state_dict() put their checkpoint file
    real = tempfile.TemporaryDirectory
    monkeypatch.setattr(tempfile, "TemporaryDirectory", lambda *a, **k: staged.append(k.get("dir")) or real(*a, **k))
    out = bench.run(["--tensors", "4", "--rows", "1024", "--cols", "2048", "--steps", "3", "--modes", "zero_offload",
                     "--nvme", state_dir, "--quiet"])
    r = out["results"]["zero_offload"]
    assert r["checkpoint_bytes"] >= 4 * 1024 * 2048 * 8, r  # the moments at least
    assert r["load_anon_peak_bytes"] < 1.0 * r["checkpoint_bytes"], r
    # On the disk beside the state, both ways (not in a /tmp that may be RAM).
    assert staged == [state_dir, state_dir], staged


def test_transformers_trainer_with_moments_on_disk(state_dir):
    from transformers import Trainer, TrainingArguments

    def train(**options):
        m = model()
        opt = ZenFlowAdamW(m.parameters(), lr=5e-4, **ASYNC, **options)
        with tempfile.TemporaryDirectory() as d:
            args = TrainingArguments(output_dir=d, per_device_train_batch_size=8, report_to="none",
                                     save_strategy="no", logging_strategy="no", disable_tqdm=True, use_cpu=True,
                                     max_steps=12)
            Trainer(model=m, args=args, train_dataset=Dataset(), optimizers=(opt, None)).train()
        opt.close()
        return m

    ram, disk = train(), train(**nvme(state_dir))
    for a, b in zip(ram.parameters(), disk.parameters()):
        assert torch.equal(a, b)


def test_deepspeed_config_with_nvme(state_dir):
    config = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": state_dir,
                                                                      "buffer_count": 5, "pin_memory": False,
                                                                      "pipeline_read": True, "pipeline_write": True},
                                    "zenflow": {"topk_ratio": 0.25, "update_interval": 2, "select_interval": 3}},
              "aio": {"block_size": 8192, "queue_depth": 16, "intra_op_parallelism": 2, "single_submit": True,
                      "overlap_events": True, "use_gds": False}}
    got = deepspeed_options(config)
    assert got["mode"] == "zenflow" and got["offload_optimizer"]["device"] == "nvme" and got["aio"]["block_size"] == 8192
    m = make_model()
    opt = ZenFlowAdamW.from_deepspeed(m.parameters(), config)
    assert opt.nvme == {"directory": state_dir, "block_bytes": 8192, "read_ahead": 2, "write_behind": 2, "pin": "none",
                        "engine": "automatic", "queue_depth": 16, "threads": 2, "master_on_disk": True}
    for s in range(4):
        train_step(m, opt, s)
    assert "O_DIRECT" in opt.nvme_status or "buffered" in opt.nvme_status
    opt.close()
    # Without the zenflow block, device nvme is ZeRO-Offload with its state on disk.
    plain = {"zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": state_dir}}}
    assert deepspeed_options(plain) == {"mode": "zero_offload",
                                        "offload_optimizer": {"device": "nvme", "nvme_path": state_dir}}


def test_nvme_keys_honoured_or_rejected(state_dir):
    base = {"device": "nvme", "nvme_path": state_dir}
    assert nvme_config(None, None) is None
    assert nvme_config({"device": "cpu"}, None) is None
    d = nvme_config(base, None)
    assert (d["read_ahead"], d["write_behind"], d["pin"], d["block_bytes"]) == (4, 4, "automatic", 1 << 20)
    # buffer_count splits between reading ahead and writing behind as the pipelines allow.
    assert (lambda d: (d["read_ahead"], d["write_behind"]))(nvme_config({**base, "buffer_count": 4}, None)) == (1, 2)
    assert (lambda d: (d["read_ahead"], d["write_behind"]))(
        nvme_config({**base, "buffer_count": 4, "pipeline_write": False}, None)) == (3, 0)
    assert (lambda d: (d["read_ahead"], d["write_behind"]))(
        nvme_config({**base, "pipeline_read": False, "pipeline_write": False}, None)) == (0, 0)
    assert nvme_config({**base, "pin_memory": True}, None)["pin"] == "required"
    assert nvme_config({**base, "io_engine": "posix"}, None)["engine"] == "posix"
    assert nvme_config(base, {"thread_count": 3})["threads"] == 3
    assert d["master_on_disk"] is True and nvme_config({**base, "master_on_disk": False}, None)["master_on_disk"] is False
    rejected = [
        ({"device": "nvme"}, None, "nvme_path"),
        ({"device": "disk", "nvme_path": state_dir}, None, "device"),
        ({"device": "cpu", "nvme_path": state_dir}, None, "device is \"cpu\""),
        ({**base, "buffer_count": 2}, None, "buffer_count"),
        ({**base, "ratio": 0.5}, None, "ratio"),
        ({**base, "io_engine": "spdk"}, None, "io_engine"),
        ({**base, "swap_folder": "x"}, None, "unknown key"),
        (base, {"block_size": 1000}, "block_size"),
        (base, {"queue_depth": 0}, "queue_depth"),
        (base, {"use_gds": True}, "GPUDirect"),
        (base, {"intra_op_parallelism": 2, "thread_count": 3}, "contradicts"),
        (base, {"block_sz": 4096}, "unknown key"),
        ({**base, "pin_memory": "yes"}, None, "pin_memory"),
        ({**base, "master_on_disk": 1}, None, "master_on_disk"),
    ]
    for offload, aio, message in rejected:
        with pytest.raises(ValueError, match=message):
            nvme_config(offload, aio)
    for offload, aio, message in [({**base, "fast_init": True}, None, "fast_init"),
                                  (base, {"single_submit": False}, "single_submit"),
                                  (base, {"overlap_events": False}, "overlap_events")]:
        with pytest.warns(UserWarning, match=message):
            nvme_config(offload, aio)
    m = make_model()
    with pytest.raises(ValueError, match="not a directory"):
        ZenFlowAdamW(m.parameters(), **nvme(os.path.join(state_dir, "missing")))
    with pytest.raises(ValueError, match="contradicts"):
        ZenFlowAdamW(m.parameters(), offload_optimizer={"device": "nvme", "nvme_path": "/elsewhere"},
                     zenflow_config={"zero_optimization": {"offload_optimizer": base}})
    if mounted_as("/dev/shm", ("tmpfs", "ramfs")):  # refused at construction, not at the first step
        with pytest.raises(ValueError, match=r"offload_optimizer\.nvme_path: .*tmpfs"):
            ZenFlowAdamW(m.parameters(), **nvme("/dev/shm"))


def test_settings_the_library_would_reject_at_the_first_step_are_rejected_at_construction(state_dir):
    # The queue must hold every block a stream may have in flight (DeepSpeed's aio default of 8
    # does not, for the default pool of 9), and the posix engine's threads serve that queue: said
    # at construction, as ValueError naming the key, not by the library when the first step()
    # creates the state file.
    m = make_model()
    offload = {"device": "nvme", "nvme_path": state_dir}
    with pytest.raises(ValueError, match=r"aio\.queue_depth: 8 is below the state file's pool of 9 blocks"):
        ZenFlowAdamW(m.parameters(), offload_optimizer=offload, aio={"queue_depth": 8})
    with pytest.raises(ValueError, match=r"aio\.thread_count: 64 threads exceed queue_depth 32"):
        ZenFlowAdamW(m.parameters(), offload_optimizer=offload, aio={"thread_count": 64})
    # A smaller pool fits a smaller queue.
    with ZenFlowAdamW(m.parameters(), offload_optimizer=dict(offload, buffer_count=5), aio={"queue_depth": 8}) as opt:
        train_step(m, opt, 0)
