"""The method's options under DeepSpeed's names, and DeepSpeed configs turned into them."""

import json
import math
import os
import warnings

# The method's options (DeepSpeed's names) and the library's defaults (include/zenflow/options.hpp).
METHOD_DEFAULTS = {
    "mode": "zenflow",
    "topk_ratio": 0.1,
    "select_strategy": "auto",
    "select_interval": "auto",
    "update_interval": "auto",
    "full_warm_up_rounds": 0,
    "overlap_step": True,
    "steps_per_epoch": 0,
    "auto_select_steps": 100,
    "max_update_interval": 16,
    "max_grad_norm": 0.0,
    "cover_cpu_update": False,
}

MODES = ("zenflow", "zero_offload", "dense")

# Keys of DeepSpeed's zero_optimization.zenflow block this optimizer takes ("cpu_state" and
# "cover_cpu_update" are zenflow's own: how the CPU columns' moments are held, and whether the
# "auto" update interval also covers the measured CPU update).
_ZENFLOW_BLOCK_KEYS = ("topk_ratio", "select_strategy", "select_interval", "update_interval",
                       "full_warm_up_rounds", "overlap_step", "steps_per_epoch", "cpu_state", "cover_cpu_update")
# Keys DeepSpeed's block may hold that describe DeepSpeed's own process layout: accepted, no effect.
_ZENFLOW_BLOCK_IGNORED = ("offload", "auto_ratio")
# The block's share of the CPUs left to the trainer: read as reserved_cpus.
_RESERVED_KEY = "pt_reserved_cores_perc"


# Counts are 64-bit in the library.
INT64_MAX = 2**63 - 1


def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def _interval(name, value):
    if isinstance(value, str) and value == "auto":
        return "auto"
    if not _is_int(value) or not 1 <= value <= INT64_MAX:
        raise ValueError(f"{name}: must be \"auto\" or an integer in [1, {INT64_MAX}], got {value!r}")
    return value


def _count(name, value, minimum):
    if not _is_int(value) or not minimum <= value <= INT64_MAX:
        raise ValueError(f"{name}: must be an integer in [{minimum}, {INT64_MAX}], got {value!r}")
    return value


def _number(name, value, low, low_open, high=None):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name}: must be a number, got {value!r}")
    value = float(value)
    ok = value == value and (value > low if low_open else value >= low)
    ok = ok and value != float("inf") and (high is None or value <= high)
    if not ok:
        bound = f"{'(' if low_open else '['}{low}, {high if high is not None else 'inf'}"
        bound += "]" if high is not None else ")"
        raise ValueError(f"{name}: must be in {bound}, got {value!r}")
    return value


def method_options(given):
    """Validated method options: `given` (None = unset) over the library's defaults.

    The baselines take the method's options as given and override what defines them: mode
    "zero_offload" runs update_interval 1 with overlap_step False, mode "dense" topk_ratio 1 (so
    one set of options can be run in every mode).
    """
    o = dict(METHOD_DEFAULTS)
    o.update({k: v for k, v in given.items() if v is not None})
    if not isinstance(o["mode"], str) or o["mode"] not in MODES:
        raise ValueError(f"mode: must be one of {', '.join(MODES)}, got {o['mode']!r}")
    o["topk_ratio"] = _number("topk_ratio", o["topk_ratio"], 0.0, True, 1.0)
    o["update_interval"] = _interval("update_interval", o["update_interval"])
    if not isinstance(o["overlap_step"], bool):
        raise ValueError(f"overlap_step: must be True or False, got {o['overlap_step']!r}")
    if not isinstance(o["cover_cpu_update"], bool):
        raise ValueError(f"cover_cpu_update: must be True or False, got {o['cover_cpu_update']!r}")
    if o["mode"] == "zero_offload":
        o["update_interval"] = 1
        o["overlap_step"] = False
    if o["mode"] == "dense":
        o["topk_ratio"] = 1.0
    if not isinstance(o["select_strategy"], str) or o["select_strategy"] not in ("auto", "step", "epoch"):
        raise ValueError(f"select_strategy: must be auto, step or epoch, got {o['select_strategy']!r}")
    o["select_interval"] = _interval("select_interval", o["select_interval"])
    o["full_warm_up_rounds"] = _count("full_warm_up_rounds", o["full_warm_up_rounds"], 0)
    o["steps_per_epoch"] = _count("steps_per_epoch", o["steps_per_epoch"], 0)
    o["auto_select_steps"] = _count("auto_select_steps", o["auto_select_steps"], 1)
    o["max_update_interval"] = _count("max_update_interval", o["max_update_interval"], 1)
    o["max_grad_norm"] = _number("max_grad_norm", o["max_grad_norm"], 0.0, False)
    return o


def _auto(value):
    return None if isinstance(value, str) and value == "auto" else value


def _block(name, value):
    """A config block: a dict (None when absent)."""
    if value is not None and not isinstance(value, dict):
        raise ValueError(f"{name}: must be a dict (a JSON object), got {type(value).__name__} {value!r}")
    return value


# The NVMe state tier (the CPU columns' moments in a state file on an SSD): DeepSpeed's
# zero_optimization.offload_optimizer and aio blocks, key by key.
# DeepSpeed's Adam and AdamW parameters (FusedAdam, DeepSpeedCPUAdam): read, checked, or ignored.
_ADAM_PARAMS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "bias_correction", "adam_w_mode", "adamw_mode")
_ADAM_PARAMS_IGNORED = ("torch_adam", "fp32_optimizer_states", "set_grad_none")
_OFFLOAD_KEYS = ("device", "nvme_path", "buffer_count", "pin_memory", "pipeline_read", "pipeline_write",
                 "fast_init", "ratio", "io_engine", "master_on_disk")
_AIO_KEYS = ("block_size", "queue_depth", "intra_op_parallelism", "thread_count", "single_submit",
             "overlap_events", "use_gds")
# The library's state_file_config / io_engine_config defaults.
NVME_DEFAULTS = {"block_bytes": 1 << 20, "read_ahead": 4, "write_behind": 4, "pin": "automatic",
                 "engine": "automatic", "queue_depth": 32, "threads": 0, "master_on_disk": True}


def _flag(name, value):
    if not isinstance(value, bool):
        raise ValueError(f"{name}: must be true or false, got {value!r}")
    return value


def nvme_config(offload_optimizer, aio):
    """The state file's settings from DeepSpeed's offload_optimizer and aio blocks (None: RAM).

    offload_optimizer: device "cpu" (state in RAM) or "nvme" (the moments in a state file under
    nvme_path, one file per rank); buffer_count: the pool's blocks (read_ahead + 1 + write_behind,
    split between reading ahead and writing behind as pipeline_read / pipeline_write allow);
    pin_memory: pin the pool (True: required, False: never; absent: when the process may);
    pipeline_read / pipeline_write: overlap the reads / writes with the CPU Adam; zenflow's own:
    io_engine ("auto", "io_uring" or "posix") and master_on_disk (True, the default: the fp32
    master lives in the file with the moments, nothing of the state in RAM; False: it stays in
    RAM). aio: block_size (bytes per I/O and checksum),
    queue_depth, intra_op_parallelism or thread_count (the posix engine's threads). Every key is
    honoured or rejected with the reason; fast_init (no effect: the file is preallocated), and
    single_submit False / overlap_events False (the engine submits each block as the stream
    issues it, and the stream always overlaps its I/O with the Adam) warn.
    """
    offload = _block("offload_optimizer", offload_optimizer) or {}
    aio = _block("aio", aio) or {}
    unknown = [k for k in offload if k not in _OFFLOAD_KEYS]
    if unknown:
        raise ValueError(f"offload_optimizer: unknown key(s) {', '.join(map(repr, unknown))}; known: "
                         f"{', '.join(_OFFLOAD_KEYS)}")
    unknown = [k for k in aio if k not in _AIO_KEYS]
    if unknown:
        raise ValueError(f"aio: unknown key(s) {', '.join(map(repr, unknown))}; known: {', '.join(_AIO_KEYS)}")
    device = offload.get("device", "cpu")
    if device not in ("cpu", "nvme"):
        raise ValueError(f"offload_optimizer.device: must be \"cpu\" or \"nvme\", got {device!r} (no offload: "
                         f"mode=\"dense\")")
    if device == "cpu":
        extra = [k for k in offload if k != "device"] + list(aio)
        if extra:
            raise ValueError(f"offload_optimizer: {', '.join(map(repr, extra))} configure the NVMe state tier, "
                             f"and device is \"cpu\" (set device \"nvme\" and nvme_path)")
        return None
    out = dict(NVME_DEFAULTS)
    path = offload.get("nvme_path")
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise ValueError(f"offload_optimizer.nvme_path: device \"nvme\" needs the path of a directory on the SSD, "
                         f"got {path!r}")
    out["directory"] = os.fspath(path)
    read = _flag("offload_optimizer.pipeline_read", offload.get("pipeline_read", True))
    write = _flag("offload_optimizer.pipeline_write", offload.get("pipeline_write", True))
    if "buffer_count" in offload:
        count = _count("offload_optimizer.buffer_count", offload["buffer_count"], 1)
        ways = int(read) + int(write)
        if count < 1 + ways:
            raise ValueError(f"offload_optimizer.buffer_count: {count} buffers cannot hold the block being updated "
                             f"and one read ahead and one written behind; need at least {1 + ways} (or turn "
                             f"pipeline_read / pipeline_write off)")
        ahead = (count - 1) // ways if read and ways else 0
        out["read_ahead"] = ahead if read else 0
        out["write_behind"] = (count - 1 - ahead) if write else 0
    else:
        out["read_ahead"] = out["read_ahead"] if read else 0
        out["write_behind"] = out["write_behind"] if write else 0
    if "pin_memory" in offload:
        out["pin"] = "required" if _flag("offload_optimizer.pin_memory", offload["pin_memory"]) else "none"
    if "fast_init" in offload:
        _flag("offload_optimizer.fast_init", offload["fast_init"])
        warnings.warn("offload_optimizer.fast_init: no effect here: the state file is preallocated (fallocate, "
                      "zero-filled) when the optimizer is built", stacklevel=4)
    if "ratio" in offload:
        ratio = _number("offload_optimizer.ratio", offload["ratio"], 0.0, True, 1.0)
        if ratio != 1.0:
            raise ValueError(f"offload_optimizer.ratio: zenflow keeps the CPU columns' state whole on the tier; "
                             f"a partial ratio ({ratio}) is not supported")
    engine = offload.get("io_engine", "auto")
    if engine not in ("auto", "io_uring", "posix"):
        raise ValueError(f"offload_optimizer.io_engine: must be \"auto\", \"io_uring\" or \"posix\", got {engine!r}")
    out["engine"] = {"auto": "automatic", "io_uring": "io_uring", "posix": "posix"}[engine]
    if "master_on_disk" in offload:
        out["master_on_disk"] = _flag("offload_optimizer.master_on_disk", offload["master_on_disk"])
    if "block_size" in aio:
        size = _count("aio.block_size", aio["block_size"], 4096)
        if size % 4096 or size > 1 << 30:
            raise ValueError(f"aio.block_size: must be a multiple of 4096 (the O_DIRECT alignment) up to 1 GiB, "
                             f"got {size}")
        out["block_bytes"] = size
    if "queue_depth" in aio:
        out["queue_depth"] = _count("aio.queue_depth", aio["queue_depth"], 1)
    threads = [aio[k] for k in ("intra_op_parallelism", "thread_count") if k in aio]
    for name in ("intra_op_parallelism", "thread_count"):
        if name in aio:
            _count(f"aio.{name}", aio[name], 1)
    if len(threads) == 2 and threads[0] != threads[1]:
        raise ValueError(f"aio: intra_op_parallelism {threads[0]} contradicts thread_count {threads[1]}")
    if threads:
        out["threads"] = threads[0]
    if "use_gds" in aio and _flag("aio.use_gds", aio["use_gds"]):
        raise ValueError("aio.use_gds: GPUDirect Storage is not supported: the CPU Adam reads the state in host "
                         "memory, so it goes through the host anyway")
    if "single_submit" in aio and not _flag("aio.single_submit", aio["single_submit"]):
        warnings.warn("aio.single_submit false: the engines submit each block's request as the stream issues "
                      "it; the stream keeps read_ahead + write_behind blocks in flight", stacklevel=4)
    if "overlap_events" in aio and not _flag("aio.overlap_events", aio["overlap_events"]):
        warnings.warn("aio.overlap_events false: the stream always overlaps its reads and writes with the CPU "
                      "Adam (pipeline_read / pipeline_write turn that off)", stacklevel=4)
    # What the state file checks when the first step creates it, here: every block of the pool may
    # be in flight at once, and the posix engine's threads serve that queue.
    buffers = out["read_ahead"] + 1 + out["write_behind"]
    if out["queue_depth"] < buffers:
        raise ValueError(f"aio.queue_depth: {out['queue_depth']} is below the state file's pool of {buffers} blocks "
                         f"(read_ahead {out['read_ahead']} + 1 + write_behind {out['write_behind']}), every one of "
                         f"which may be in flight: raise it to at least {buffers}, or lower "
                         f"offload_optimizer.buffer_count")
    if out["threads"] > out["queue_depth"]:
        raise ValueError(f"aio.thread_count: {out['threads']} threads exceed queue_depth {out['queue_depth']} (the "
                         f"requests in flight they serve)")
    return out


def usable_cpus():
    """How many CPUs this process may run on (its affinity where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no sched_getaffinity on this OS
        return os.cpu_count() or 1


def reserved_cpus_of(fraction, name):
    """DeepSpeed's pt_reserved_cores_perc as a count of CPUs, as DeepSpeed's ZenFlow rounds it (up),
    leaving the coordinator at least one CPU."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 <= fraction <= 1.0:
        raise ValueError(f"{name}: must be a fraction of the CPUs in [0, 1], got {fraction!r}")
    n = usable_cpus()
    return min(math.ceil(fraction * n), n - 1)


def deepspeed_options(config):
    """Keyword arguments of ZenFlowAdamW from a DeepSpeed config.

    `config` is a whole DeepSpeed config (a dict, or the path of its JSON file) or just its
    ``zero_optimization.zenflow`` block. "auto" values mean the optimizer's defaults (the library's
    own "auto" for select_strategy, select_interval and update_interval). Read:
      zero_optimization.zenflow   -> mode "zenflow" and the method's options (and zenflow's own
                                     "cpu_state": "fp32", "bf16_moments" or "blockwise8_moments",
                                     and "cover_cpu_update"); its pt_reserved_cores_perc -> reserved_cpus
                                     (that fraction of the CPUs this process may use, rounded up, at
                                     most all but one; without the key none is reserved, where
                                     DeepSpeed reserves half);
      zero_optimization.offload_optimizer.device "cpu" or "nvme" without a zenflow block -> mode
                                     "zero_offload";
      neither -> mode "dense";
      zero_optimization.offload_optimizer with device "nvme", and aio -> offload_optimizer and aio
                                     (the NVMe state tier: see :func:`nvme_config`);
      optimizer.params            -> lr, betas, eps, weight_decay (type Adam or AdamW; amsgrad,
                                     bias_correction false and adam_w_mode false are rejected,
                                     torch_adam, fp32_optimizer_states and set_grad_none ignored
                                     with a warning, any other key rejected);
      gradient_clipping           -> max_grad_norm;
      gradient_accumulation_steps -> gradient_accumulation_steps.
    """
    if isinstance(config, (str, os.PathLike)):
        with open(config, encoding="utf-8") as f:
            config = json.load(f)
    if not isinstance(config, dict):
        raise ValueError(f"config: must be a dict or the path of a JSON file, got {type(config).__name__}")
    whole = "zero_optimization" in config or "optimizer" in config
    zero = (_block("zero_optimization", config.get("zero_optimization")) or {}) if whole else {}
    block = _block("zero_optimization.zenflow", zero.get("zenflow")) if whole else config
    out = {}
    if block is not None:
        out["mode"] = "zenflow"
        known = _ZENFLOW_BLOCK_KEYS + (_RESERVED_KEY,) + _ZENFLOW_BLOCK_IGNORED
        unknown = [k for k in block if k not in known]
        if unknown:
            raise ValueError(f"zenflow: unknown key(s) {', '.join(map(repr, unknown))}; known: {', '.join(known)}")
        ignored = [k for k in block if k in _ZENFLOW_BLOCK_IGNORED]
        if ignored:
            warnings.warn(f"zenflow: {', '.join(ignored)} configure DeepSpeed's worker process and have "
                          f"no effect here", stacklevel=3)
        for key in _ZENFLOW_BLOCK_KEYS:
            if key not in block:
                continue
            value = block[key]
            if key in ("select_strategy", "select_interval", "update_interval"):
                out[key] = value
            elif _auto(value) is not None:
                out[key] = value
        if _auto(block.get(_RESERVED_KEY)) is not None:
            out["reserved_cpus"] = reserved_cpus_of(block[_RESERVED_KEY], f"zenflow.{_RESERVED_KEY}")
    offload = (_block("zero_optimization.offload_optimizer", zero.get("offload_optimizer")) or {}) if whole else {}
    device = offload.get("device", "none")
    if device not in ("none", "cpu", "nvme"):  # DeepSpeed's OffloadDeviceEnum (a typo is not "none")
        raise ValueError(f"zero_optimization.offload_optimizer.device: must be \"none\", \"cpu\" or \"nvme\" "
                         f"(DeepSpeed's values), got {device!r}")
    if block is None and whole:
        out["mode"] = "zero_offload" if device in ("cpu", "nvme") else "dense"
    if whole and device == "nvme":
        out["offload_optimizer"] = dict(offload)
        if config.get("aio") is not None:
            out["aio"] = dict(_block("aio", config.get("aio")))
    if whole:
        opt = _block("optimizer", config.get("optimizer"))
        if opt is not None:
            kind = str(opt.get("type", "AdamW")).lower()
            if kind not in ("adam", "adamw"):
                raise ValueError(f"optimizer.type: must be Adam or AdamW, got {opt.get('type')!r}")
            params = _block("optimizer.params", opt.get("params")) or {}
            unknown = [k for k in params if k not in _ADAM_PARAMS + _ADAM_PARAMS_IGNORED]
            if unknown:
                raise ValueError(f"optimizer.params: unknown key(s) {', '.join(map(repr, unknown))}; known: "
                                 f"{', '.join(_ADAM_PARAMS + _ADAM_PARAMS_IGNORED)}")
            for key in ("adam_w_mode", "adamw_mode"):
                if kind == "adam" and params.get(key, True) is False:
                    raise ValueError(f"optimizer.params.{key}: only AdamW (decoupled weight decay) is supported")
            if params.get("amsgrad", False):
                raise ValueError(f"optimizer.params.amsgrad: not supported by zenflow's Adam, got "
                                 f"{params['amsgrad']!r}")
            if params.get("bias_correction", True) is not True:
                raise ValueError(f"optimizer.params.bias_correction: zenflow's Adam always corrects the moments' "
                                 f"bias (torch.optim.AdamW's rule), got {params['bias_correction']!r}")
            ignored = [k for k in params if k in _ADAM_PARAMS_IGNORED]
            if ignored:
                warnings.warn(f"optimizer.params: {', '.join(ignored)} select DeepSpeed's Adam implementation and "
                              f"have no effect here", stacklevel=3)
            for key in ("lr", "betas", "eps", "weight_decay"):
                if _auto(params.get(key)) is not None:
                    value = params[key]
                    if key == "betas":
                        if not isinstance(value, (list, tuple)):
                            raise ValueError(f"optimizer.params.betas: must be a list of two numbers, got {value!r}")
                        value = tuple(value)
                    out[key] = value
        if _auto(config.get("gradient_clipping")) is not None:
            out["max_grad_norm"] = config["gradient_clipping"]
        if _auto(config.get("gradient_accumulation_steps")) is not None:
            out["gradient_accumulation_steps"] = config["gradient_accumulation_steps"]
    return out
