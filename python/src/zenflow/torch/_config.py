"""The method's options under DeepSpeed's names, and DeepSpeed configs turned into them."""

import json
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
}

MODES = ("zenflow", "zero_offload", "dense")

# Keys of DeepSpeed's zero_optimization.zenflow block this optimizer takes ("cpu_state" is
# zenflow's own: how the CPU columns' moments are held).
_ZENFLOW_BLOCK_KEYS = ("topk_ratio", "select_strategy", "select_interval", "update_interval",
                       "full_warm_up_rounds", "overlap_step", "steps_per_epoch", "cpu_state")
# Keys DeepSpeed's block may hold that describe DeepSpeed's own process layout: accepted, no effect.
_ZENFLOW_BLOCK_IGNORED = ("offload", "pt_reserved_cores_perc", "auto_ratio")


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


def deepspeed_options(config):
    """Keyword arguments of ZenFlowAdamW from a DeepSpeed config.

    `config` is a whole DeepSpeed config (a dict, or the path of its JSON file) or just its
    ``zero_optimization.zenflow`` block. "auto" values mean the optimizer's defaults (the library's
    own "auto" for select_strategy, select_interval and update_interval). Read:
      zero_optimization.zenflow   -> mode "zenflow" and the method's options (and zenflow's own
                                     "cpu_state": "fp32", "bf16_moments" or "blockwise8_moments");
      zero_optimization.offload_optimizer.device "cpu" without a zenflow block -> mode "zero_offload";
      neither -> mode "dense";
      optimizer.params            -> lr, betas, eps, weight_decay (type Adam or AdamW);
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
        unknown = [k for k in block if k not in _ZENFLOW_BLOCK_KEYS and k not in _ZENFLOW_BLOCK_IGNORED]
        if unknown:
            raise ValueError(f"zenflow: unknown key(s) {', '.join(map(repr, unknown))}; known: "
                             f"{', '.join(_ZENFLOW_BLOCK_KEYS + _ZENFLOW_BLOCK_IGNORED)}")
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
    elif whole:
        device = (_block("zero_optimization.offload_optimizer", zero.get("offload_optimizer")) or {}).get("device", "none")
        out["mode"] = "zero_offload" if device == "cpu" else "dense"
    if whole:
        opt = _block("optimizer", config.get("optimizer"))
        if opt is not None:
            kind = str(opt.get("type", "AdamW")).lower()
            if kind not in ("adam", "adamw"):
                raise ValueError(f"optimizer.type: must be Adam or AdamW, got {opt.get('type')!r}")
            params = _block("optimizer.params", opt.get("params")) or {}
            if kind == "adam" and params.get("adam_w_mode", True) is False:
                raise ValueError("optimizer.params.adam_w_mode: only AdamW (decoupled weight decay) is "
                                 "supported")
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
