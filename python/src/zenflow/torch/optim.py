"""ZenFlowAdamW: the zenflow coordinator behind torch.optim.Optimizer's interface."""

import atexit
import math
import os
import tempfile
import weakref

import torch
from torch import nn

from . import _C
from ._config import METHOD_DEFAULTS, deepspeed_options, method_options

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_CHECKPOINT_FORMAT = 1

# Optimizers still open; closed (CPU work completed and written back) at interpreter exit.
_open = weakref.WeakSet()


@atexit.register
def _close_all():
    for opt in list(_open):
        try:
            opt.close()
        except Exception:  # noqa: BLE001 -- exit must go on
            pass


def param_groups(model, weight_decay=1e-2, no_decay=(nn.LayerNorm,), **group_options):
    """Parameter groups for ``model`` under the usual fine-tuning recipe.

    Returns [decay, no_decay]: 1-D parameters (biases, norm weights) and every parameter of a
    module of a type in ``no_decay`` get weight_decay 0; the rest ``weight_decay``. Weights of
    ``nn.Embedding`` modules get ``column_dim=0`` (a column is one embedding; see ZenFlowAdamW).
    Parameters with requires_grad False are left out. Names are kept (``param_names``).
    """
    embedding = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    exempt = set()
    for m in model.modules():
        if isinstance(m, tuple(no_decay)):
            exempt.update(id(p) for p in m.parameters(recurse=False))
    groups = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        decay = 0.0 if p.dim() < 2 or id(p) in exempt else weight_decay
        column_dim = 0 if id(p) in embedding else 1
        g = groups.setdefault((decay, column_dim), {"params": [], "param_names": [],
                                                    "weight_decay": decay, "column_dim": column_dim,
                                                    **group_options})
        g["params"].append(p)
        g["param_names"].append(name)
    return list(groups.values())


class ZenFlowAdamW(torch.optim.Optimizer):
    r"""AdamW whose optimizer state lives in CPU memory, updated the ZenFlow way.

    Arguments follow ``torch.optim.AdamW`` (lr, betas, eps, weight_decay; per parameter group),
    then the method's options under DeepSpeed's names:

    mode
        ``"zenflow"`` (the method; ``overlap_step`` True: asynchronous CPU update, False: sync),
        ``"zero_offload"`` (every column on the CPU, every step, synchronously) or ``"dense"``
        (every column on the device: the no-offload reference).
    topk_ratio, select_strategy, select_interval, update_interval, full_warm_up_rounds,
    overlap_step, steps_per_epoch, auto_select_steps, max_update_interval
        as in DeepSpeed's ``zero_optimization.zenflow`` block (``"auto"`` where it takes it);
        defaults are the library's (``include/zenflow/options.hpp``).
    max_grad_norm
        clip the global gradient norm of the step (both paths together) to this; 0: no clipping.
    zenflow_config
        a DeepSpeed config (dict or JSON path) or its ``zenflow`` block; see
        :func:`zenflow.torch.deepspeed_options`. Explicit arguments must agree with it.
    gradient_accumulation_steps
        backward passes per step: gradients are handed over during the last one.
    submit_in_backward
        hand each gradient over from ``register_post_accumulate_grad_hook`` as backward produces
        it, so the offload overlaps backward (default). Set False to hand them over in ``step()``,
        after code that changes ``.grad`` between backward and step (``clip_grad_norm_``,
        ``GradScaler.unscale_``).
    cpu_threads, record_trace
        the CPU Adam's thread pool size (0: every core this process may use); keep a record per
        CPU update (:meth:`trace`).
    process_group, timeout
        data parallel (e.g. under ``torchrun``): a ``torch.distributed`` process group (or
        ``torch.distributed.group.WORLD``) whose ranks each run this optimizer on their own
        micro-batch; ``step()`` applies the mean of their gradients, and each rank holds the CPU
        state of 1/N of every 2-D parameter's columns (:meth:`owned_columns`). zenflow averages
        the gradients itself: do not also wrap the model in DDP. CPU tensors: the optimizer runs
        its collectives on a Gloo group of its own over the same ranks. CUDA tensors (one GPU per
        rank): on an NCCL communicator of its own, on ``torch.cuda.current_stream()``, whose
        unique id the first rank sends over that Gloo group (needs a build with NCCL,
        ``nccl_available()``). A collective that does not complete within ``timeout`` (seconds
        or a ``timedelta``; default 600 s), or a rank that fails, fails the step on every rank.
        Construction is collective: every rank constructs the optimizer, which registers the
        parameters and, as DDP does, copies the first rank's parameter values to the others.

    Columns: the importance selector scores *columns* (input channels) of 2-D parameters. With
    ``column_dim=1`` (default; ``nn.Linear.weight`` [out, in]) column j is ``W[:, j]``; with
    ``column_dim=0`` (``nn.Embedding.weight`` [num, dim], see :func:`param_groups`) column j is
    the embedding ``W[j, :]``. Parameters with more dimensions are seen as
    ``[size(0), numel / size(0)]``; 1-D (and 0-D) parameters are always updated on the device.

    Parameters must be contiguous float32/bfloat16/float16 tensors, all on the CPU or all on one
    CUDA device. The optimizer registers them (copying their values as the fp32 master) at the
    first backward or step: load pretrained weights before that.

    With ``overlap_step`` the CPU columns' update of an interval reaches the parameters up to one
    interval later; call :meth:`flush` before evaluating or saving the model's weights.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, *,
                 amsgrad=False, maximize=False, mode=None, topk_ratio=None, select_strategy=None,
                 select_interval=None, update_interval=None, full_warm_up_rounds=None, overlap_step=None,
                 steps_per_epoch=None, auto_select_steps=None, max_update_interval=None, max_grad_norm=None,
                 zenflow_config=None, gradient_accumulation_steps=1, submit_in_backward=True, cpu_threads=0,
                 record_trace=False, column_dim=1, process_group=None, timeout=600.0):
        if amsgrad:
            raise ValueError("amsgrad: not supported by zenflow's Adam")
        if maximize:
            raise ValueError("maximize: not supported by zenflow's Adam")
        given = {"mode": mode, "topk_ratio": topk_ratio, "select_strategy": select_strategy,
                 "select_interval": select_interval, "update_interval": update_interval,
                 "full_warm_up_rounds": full_warm_up_rounds, "overlap_step": overlap_step,
                 "steps_per_epoch": steps_per_epoch, "auto_select_steps": auto_select_steps,
                 "max_update_interval": max_update_interval, "max_grad_norm": max_grad_norm}
        adam = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay,
                "gradient_accumulation_steps": gradient_accumulation_steps}
        if zenflow_config is not None:
            torch_defaults = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2,
                              "gradient_accumulation_steps": 1}
            for key, value in deepspeed_options(zenflow_config).items():
                if key in given:
                    if given[key] is not None and given[key] != value:
                        raise ValueError(f"{key}: {given[key]!r} contradicts zenflow_config's {value!r}")
                    given[key] = value
                else:
                    if adam[key] != torch_defaults[key] and adam[key] != value:
                        raise ValueError(f"{key}: {adam[key]!r} contradicts zenflow_config's {value!r}")
                    adam[key] = value
        self._method = method_options(given)
        if isinstance(adam["gradient_accumulation_steps"], bool) or \
                not isinstance(adam["gradient_accumulation_steps"], int) or adam["gradient_accumulation_steps"] < 1:
            raise ValueError(f"gradient_accumulation_steps: must be an integer >= 1, "
                             f"got {adam['gradient_accumulation_steps']!r}")
        if not isinstance(cpu_threads, int) or cpu_threads < 0:
            raise ValueError(f"cpu_threads: must be an integer >= 0, got {cpu_threads!r}")
        self.gradient_accumulation_steps = adam["gradient_accumulation_steps"]
        self.submit_in_backward = bool(submit_in_backward)
        self._config = {"cpu_threads": cpu_threads, "pin_threads": False, "d2h_slot_bytes": 4 << 20,
                        "d2h_slots": 4, "h2d_slot_bytes": 4 << 20, "h2d_slots": 2,
                        "record_trace": bool(record_trace)}
        self._core = None
        self._closed = False
        self._hooks = []
        self._process_group = process_group
        self._own_group = None
        if hasattr(timeout, "total_seconds"):
            timeout = timeout.total_seconds()
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"timeout: must be a number of seconds > 0 or a timedelta, got {timeout!r}")
        self._timeout = float(timeout)
        defaults = {"lr": adam["lr"], "betas": adam["betas"], "eps": adam["eps"],
                    "weight_decay": adam["weight_decay"], "column_dim": column_dim}
        super().__init__(params, defaults)
        self._params = [p for g in self.param_groups for p in g["params"]]
        self._names = []
        for gi, g in enumerate(self.param_groups):
            names = g.get("param_names")
            for pi, _ in enumerate(g["params"]):
                self._names.append(names[pi] if names else f"param_groups[{gi}].params[{pi}]")
        self._check_params()
        self._submitted = [None] * len(self._params)
        self._backward_count = [0] * len(self._params)
        self._metrics = {}
        self._pushed = None
        ref = weakref.ref(self)
        for i, p in enumerate(self._params):
            # A frozen parameter (requires_grad False: skipped while it has no gradient) cannot
            # take a hook; should it get a gradient later, step() hands it over.
            if p.requires_grad:
                self._hooks.append(p.register_post_accumulate_grad_hook(_hook(ref, i)))
        _open.add(self)
        if process_group is not None:
            self._built()  # collective: every rank registers now, from the first rank's values

    @classmethod
    def from_deepspeed(cls, params, config, **kwargs):
        """The optimizer a DeepSpeed config describes (see :func:`zenflow.torch.deepspeed_options`)."""
        return cls(params, zenflow_config=config, **kwargs)

    # -- torch.optim.Optimizer ----------------------------------------------------------------

    def add_param_group(self, param_group):
        if getattr(self, "_core", None) is not None:
            raise ValueError("add_param_group: parameters must be added before the first backward or step")
        param_group = dict(param_group)
        super().add_param_group(param_group)
        g = self.param_groups[-1]
        _check_hyper(g, len(self.param_groups) - 1)
        if hasattr(self, "_params"):  # after __init__
            start = len(self._params)
            self._params.extend(g["params"])
            names = g.get("param_names")
            self._names.extend(names[k] if names else f"param_groups[{len(self.param_groups) - 1}].params[{k}]"
                               for k in range(len(g["params"])))
            self._check_params()
            self._submitted.extend([None] * len(g["params"]))
            self._backward_count.extend([0] * len(g["params"]))
            ref = weakref.ref(self)
            for i in range(start, len(self._params)):
                if self._params[i].requires_grad:
                    self._hooks.append(self._params[i].register_post_accumulate_grad_hook(_hook(ref, i)))

    def zero_grad(self, set_to_none=True):
        self._backward_count = [0] * len(self._params)
        super().zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self, closure=None):
        """Ends the training step: hands over the gradients not handed over during backward, then
        runs the coordinator's step (device update of the selected columns and 1-D parameters,
        offload of the rest, the CPU schedule). Returns the closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        core = self._built()
        features = self._features
        # Check everything first: a step that raises changes nothing here.
        missing = []
        for i, p in enumerate(self._params):
            if p.data_ptr() != self._data_ptrs[i]:
                raise ValueError(f"params: {self._names[i]}'s storage changed after registration "
                                 f"(was param.data replaced?)")
            if p.grad is None:
                missing.append(i)
            elif self._submitted[i] is None or self._submitted[i] is not p.grad:
                self._check_grad(i, p.grad)
        if missing and not features["skips_missing_gradients"]:
            raise ValueError(f"grad: {self._names[missing[0]]} has no gradient in this step "
                             f"({len(missing)} parameter(s) without one). This build's coordinator needs "
                             f"every parameter's gradient every step: leave frozen or unused parameters "
                             f"out of the optimizer")
        changes = self._hyper_changes()
        if changes and not features["set_adam_options"]:
            gi, _ = changes[0]
            raise ValueError(f"param_groups[{gi}]: lr, betas, eps or weight_decay changed, and this build's "
                             f"coordinator has fixed Adam hyper-parameters (it has no set_adam_options)")
        # Apply.
        for gi, adam in changes:
            for i in self._group_index[gi]:
                core.set_adam_options(i, adam)
            self._pushed[gi] = adam
        stream = self._stream()
        for i, p in enumerate(self._params):
            if p.grad is not None and self._submitted[i] is not p.grad:
                core.submit(i, p.grad, stream)
                self._submitted[i] = p.grad
        self._metrics = core.step(stream)
        self._submitted = [None] * len(self._params)
        self._backward_count = [0] * len(self._params)
        return loss

    def state_dict(self):
        """torch's state dict plus ``"zenflow"``: the library's checkpoint (bytes) of the whole
        optimizer state and of the parameters' values; pending CPU work stays pending, so a run
        resumed from it continues bit-identically."""
        sd = super().state_dict()
        checkpoint = None
        if self._core is not None:
            with tempfile.TemporaryDirectory(prefix="zenflow-") as d:
                path = os.path.join(d, "checkpoint.zf")
                self._core.save(path, self._stream())
                with open(path, "rb") as f:
                    checkpoint = f.read()
        sd["zenflow"] = {"format": _CHECKPOINT_FORMAT, "checkpoint": checkpoint, "mode": self._method["mode"]}
        return sd

    def load_state_dict(self, state_dict):
        """Restores a state dict from :meth:`state_dict` of an optimizer with the same options and
        parameters (the parameters' values are restored too). Rejected, with nothing changed, if
        it does not match."""
        state_dict = dict(state_dict)
        zf = state_dict.pop("zenflow", None)
        if not isinstance(zf, dict) or zf.get("format") != _CHECKPOINT_FORMAT:
            raise ValueError("state_dict: has no zenflow checkpoint of format "
                             f"{_CHECKPOINT_FORMAT} (was it written by ZenFlowAdamW.state_dict?)")
        if zf.get("mode") != self._method["mode"]:
            raise ValueError(f"state_dict: was written in mode {zf.get('mode')!r}, this optimizer runs "
                             f"{self._method['mode']!r}")
        old_groups = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        super().load_state_dict(state_dict)
        old_core = self._core
        try:
            self._core = None
            self._check_params()
            if zf["checkpoint"] is not None:
                core = self._built()
                with tempfile.TemporaryDirectory(prefix="zenflow-") as d:
                    path = os.path.join(d, "checkpoint.zf")
                    with open(path, "wb") as f:
                        f.write(zf["checkpoint"])
                    core.load(path, self._stream())
        except Exception:
            if self._core is not None:
                self._core.close()
            self._core = old_core
            for g, old in zip(self.param_groups, old_groups):
                g.update(old)
            raise
        if old_core is not None:
            old_core.close()
        self._submitted = [None] * len(self._params)
        self._backward_count = [0] * len(self._params)

    # -- zenflow --------------------------------------------------------------------------------

    def metrics(self):
        """The last step's step_metrics as a dict: stall_seconds, stall_reason, cpu_update_seconds,
        bytes_device_to_host, bytes_host_to_device, selection_overlap, interval, reselected,
        cpu_update_launched, written_back, step."""
        return dict(self._metrics)

    def trace(self):
        """One dict per CPU update (interval, first_step, last_step, accumulated_steps,
        written_back_at, write_backs, synchronous); needs ``record_trace=True``."""
        return self._core.trace() if self._core is not None else []

    def gpu_columns(self, param):
        """Columns of ``param`` (a tensor of this optimizer) updated on the device now."""
        for i, p in enumerate(self._params):
            if p is param:
                return self._core.gpu_columns(i) if self._core is not None else []
        raise ValueError("param: not a parameter of this optimizer")

    def owned_columns(self, param):
        """(first, last): the columns of 2-D ``param`` whose CPU state this rank holds (all of them
        in one process; 1/N of them per rank with a process group). (0, 0) for a 1-D one."""
        core = self._built()
        for i, p in enumerate(self._params):
            if p is param:
                return tuple(core.owned_columns(i))
        raise ValueError("param: not a parameter of this optimizer")

    @property
    def options(self):
        """The method's options in effect (DeepSpeed's names)."""
        return dict(self._method)

    def flush(self):
        """Completes all CPU work and writes it into the parameters (before evaluating or saving
        the model's weights); training may go on. Synchronizes."""
        if self._core is not None:
            self._core.finish(self._stream())

    def close(self):
        """flush(), then stops the coordinator's threads and frees its state. Idempotent; also
        called at interpreter exit and by ``with``."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._core is not None:
                self.flush()
        finally:
            for h in self._hooks:
                h.remove()
            self._hooks = []
            if self._core is not None:
                self._core.close()
                self._core = None
            _open.discard(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __del__(self):
        core = getattr(self, "_core", None)
        if core is not None:
            core.close()

    # -- internals ------------------------------------------------------------------------------

    def _check_params(self):
        devices = set()
        for i, p in enumerate(self._params):
            name = self._names[i]
            if not isinstance(p, torch.Tensor):
                raise ValueError(f"params: {name} is a {type(p).__name__}, not a tensor")
            if p.is_sparse or p.layout != torch.strided:
                raise ValueError(f"params: {name} is not a dense tensor ({p.layout})")
            if p.dtype not in _DTYPES:
                raise ValueError(f"params: {name} has dtype {p.dtype}; supported: float32, bfloat16, float16")
            if not p.is_contiguous():
                raise ValueError(f"params: {name} is not contiguous")
            if p.numel() == 0:
                raise ValueError(f"params: {name} is empty")
            if p.device.type not in ("cpu", "cuda"):
                raise ValueError(f"params: {name} is on {p.device}; supported: cpu, cuda")
            if p.device.type == "cuda" and not _C.with_cuda:
                raise ValueError(f"params: {name} is a CUDA tensor, but zenflow.torch was built without its "
                                 f"CUDA backend: {_C.cuda_reason}")
            if not p.requires_grad and not _C.features()["skips_missing_gradients"]:
                raise ValueError(f"params: {name} has requires_grad=False; leave frozen parameters out of "
                                 f"the optimizer")
            devices.add(p.device)
        if len(devices) > 1:
            raise ValueError(f"params: all parameters must be on one device, got "
                             f"{', '.join(sorted(map(str, devices)))}")
        for gi, g in enumerate(self.param_groups):
            cd = g.get("column_dim", 1)
            if cd not in (0, 1):
                raise ValueError(f"param_groups[{gi}]: column_dim must be 0 or 1, got {cd!r}")

    def _check_grad(self, i, grad):
        p, name = self._params[i], self._names[i]
        if grad.is_sparse or grad.layout != torch.strided:
            raise ValueError(f"grad: {name}'s gradient is sparse; use dense gradients (nn.Embedding(sparse=False))")
        if grad.device != p.device:
            raise ValueError(f"grad: {name}'s gradient is on {grad.device}, the parameter on {p.device}")
        if grad.dtype != p.dtype:
            raise ValueError(f"grad: {name}'s gradient has dtype {grad.dtype}, the parameter {p.dtype}")
        if grad.shape != p.shape:
            raise ValueError(f"grad: {name}'s gradient has shape {tuple(grad.shape)}, the parameter "
                             f"{tuple(p.shape)}")
        if not grad.is_contiguous():
            raise ValueError(f"grad: {name}'s gradient is not contiguous")

    def _device(self):
        return self._params[0].device if self._params else torch.device("cpu")

    def _stream(self):
        d = self._device()
        return torch.cuda.current_stream(d).cuda_stream if d.type == "cuda" else 0

    def _adam(self, g):
        return {"lr": float(g["lr"]), "beta1": float(g["betas"][0]), "beta2": float(g["betas"][1]),
                "eps": float(g["eps"]), "weight_decay": float(g["weight_decay"]), "adamw_mode": True}

    def _hyper_changes(self):
        return [(gi, self._adam(g)) for gi, g in enumerate(self.param_groups)
                if self._adam(g) != self._pushed[gi]]

    def _built(self):
        if self._closed:
            raise ValueError("optimizer: is closed")
        if self._core is not None:
            return self._core
        if not self._params:
            raise ValueError("params: the optimizer has no parameters")
        for gi, g in enumerate(self.param_groups):
            _check_hyper(g, gi)
        adams = [self._adam(g) for g in self.param_groups]
        options = dict(self._method, adam=adams[0])
        device = self._device()
        if self._process_group is not None:
            core = self._data_parallel_core(options, device)
        elif device.type == "cuda":
            with torch.cuda.device(device):
                core = _C.Coordinator(options, self._config, "cuda")
        else:
            core = _C.Coordinator(options, self._config, "cpu")
        self._features = core.features()
        if not self._features["per_parameter_adam"]:
            for gi, a in enumerate(adams):
                if a != adams[0]:
                    core.close()
                    raise ValueError(f"param_groups[{gi}]: lr, betas, eps or weight_decay differ from "
                                     f"param_groups[0]'s, and this build's coordinator has one set for all "
                                     f"parameters (no per-parameter Adam options)")
        self._group_index = []
        # The coordinator writes through the registered storage until it is closed: keep that
        # storage alive even if a parameter's .data is replaced (which step() then rejects).
        self._registered = [p.detach() for p in self._params]
        index = 0
        try:
            for gi, g in enumerate(self.param_groups):
                self._group_index.append([])
                for p in g["params"]:
                    name = self._names[index]
                    view = self._registered[index]
                    if p.dim() >= 2:
                        k = core.add_matrix(name, view, int(g.get("column_dim", 1)), adams[gi])
                    else:
                        k = core.add_vector(name, view, adams[gi])
                    assert k == index
                    self._group_index[gi].append(index)
                    index += 1
        except Exception:
            core.close()
            raise
        self._data_ptrs = [p.data_ptr() for p in self._registered]
        self._pushed = adams
        self._core = core
        return core

    def _data_parallel_core(self, options, device):
        """The coordinator of one rank of ``process_group``: on a Gloo group of its own (CPU
        tensors), or on NCCL with its unique id sent over that group (CUDA tensors)."""
        import torch.distributed as dist
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("process_group: torch.distributed is not initialized "
                             "(torch.distributed.init_process_group)")
        if device.type == "cuda" and not _C.with_nccl:
            raise ValueError(f"process_group: the parameters are on {device}, and data parallel on CUDA tensors "
                             f"needs zenflow.torch built with NCCL: {_C.nccl_reason}")
        if self._own_group is None:
            ranks = dist.get_process_group_ranks(self._process_group)
            # The coordinator's collectives run on worker threads: on a group of their own they
            # never interleave with the trainer's.
            self._own_group = dist.new_group(ranks=ranks, backend="gloo", use_local_synchronization=True)
            for p in self._params:
                values = p.data if p.device.type == "cpu" else p.data.cpu()
                dist.broadcast(values, src=ranks[0], group=self._own_group)
                if values is not p.data:
                    p.data.copy_(values)
        if device.type == "cuda":
            first = dist.get_process_group_ranks(self._own_group)[0]
            if dist.get_rank() == first:
                nccl_id = torch.frombuffer(bytearray(_C.nccl_unique_id()), dtype=torch.uint8)
            else:
                nccl_id = torch.zeros(128, dtype=torch.uint8)
            dist.broadcast(nccl_id, src=first, group=self._own_group)
            with torch.cuda.device(device):
                return _C.Coordinator(options, self._config, "cuda", self._own_group, None, self._timeout,
                                      nccl_id.numpy().tobytes())
        store = dist.distributed_c10d._get_process_group_store(self._own_group)
        return _C.Coordinator(options, self._config, "cpu", self._own_group, store, self._timeout)

    def _hand_over(self, i, param):
        """The post-accumulate-grad hook of parameter i."""
        if self._closed or not self.submit_in_backward:
            return
        self._backward_count[i] += 1
        if self._backward_count[i] < self.gradient_accumulation_steps or param.grad is None:
            return
        core = self._built()
        self._check_grad(i, param.grad)
        core.submit(i, param.grad, self._stream())
        self._submitted[i] = param.grad


def _hook(ref, i):
    def hook(param):
        opt = ref()
        if opt is not None:
            opt._hand_over(i, param)
    return hook


def _check_hyper(g, gi):
    lr = g["lr"]
    lr = float(lr.item() if isinstance(lr, torch.Tensor) else lr)
    if not (math.isfinite(lr) and lr >= 0.0):
        raise ValueError(f"param_groups[{gi}]: lr must be finite and >= 0, got {g['lr']!r}")
    betas = g["betas"]
    if len(betas) != 2 or not all(0.0 <= float(b) < 1.0 for b in betas):
        raise ValueError(f"param_groups[{gi}]: betas must be two values in [0, 1), got {betas!r}")
    if not (math.isfinite(float(g["eps"])) and float(g["eps"]) > 0.0):
        raise ValueError(f"param_groups[{gi}]: eps must be finite and > 0, got {g['eps']!r}")
    if not (math.isfinite(float(g["weight_decay"])) and float(g["weight_decay"]) >= 0.0):
        raise ValueError(f"param_groups[{gi}]: weight_decay must be finite and >= 0, got {g['weight_decay']!r}")


# The defaults of the method, for documentation tools.
ZenFlowAdamW.METHOD_DEFAULTS = dict(METHOD_DEFAULTS)
