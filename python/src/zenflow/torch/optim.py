"""ZenFlowAdamW: the zenflow coordinator behind torch.optim.Optimizer's interface.

torch.optim's contract comes first: step() reads ``.grad`` as it is when step() is called,
zero_grad() drops what a step has not consumed, and a weight the user edited between steps is the
weight the optimizer continues from (tensor version counters tell which were edited).
"""

import atexit
import datetime
import hashlib
import itertools
import math
import numbers
import os
import struct
import sys
import tempfile
import warnings
import weakref

import torch
from torch import nn
from torch.autograd.profiler import record_function

from . import _C
from ._config import INT64_MAX, METHOD_DEFAULTS, deepspeed_options, method_options, nvme_config, usable_cpus

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# coordinator_config::cpu_state's spellings (cpu_state_format_name).
CPU_STATES = ("fp32", "bf16_moments", "blockwise8_moments")
# Format of state_dict()["zenflow"]: 2 holds the optimizer state alone (the parameters are the
# model's, as with torch.optim); 1 (the library's checkpoint with the parameters' values) is not read.
_CHECKPOINT_FORMAT = 2
# state_dict()["zenflow"]["columns"] in zero_offload mode: every 2-D parameter registered with
# column_dim=0 (see ZenFlowAdamW._registered_column_dim).
_ZERO_OFFLOAD_COLUMNS = "column_dim_0"
_FLOAT32_MAX = 3.4028234663852886e38

# Optimizers still open; closed (CPU work completed and written back) at interpreter exit.
_state_files = itertools.count()  # names each NVMe state file this process creates
_open = weakref.WeakSet()


@atexit.register
def _close_all():
    # An exception that ends the program (sys.last_value): a data-parallel optimizer aborts its
    # group instead of flushing, which is a collective its peers, still training, would not join
    # (they would wait for the timeout, and fail without this rank's reason).
    failed = getattr(sys, "last_value", None)
    for opt in list(_open):
        try:
            if failed is not None and opt._process_group is not None:
                opt.abort(f"the program on this rank ended with {type(failed).__name__}: {failed}")
            else:
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
    r"""AdamW whose optimizer state lives in CPU memory, updated the ZenFlow way; otherwise it works
    like ``torch.optim.AdamW``.

    Arguments follow ``torch.optim.AdamW`` (lr, betas, eps, weight_decay; per parameter group;
    ``foreach`` and ``fused`` are accepted and change nothing, as they choose torch's
    implementation; ``amsgrad``, ``maximize``, ``capturable`` and ``differentiable`` must be
    False), then the method's options under DeepSpeed's names. A parameter frozen when it is added
    (``requires_grad`` False) is left out: it holds no state, and a gradient on it later is rejected.

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
        ``torch.nn.utils.clip_grad_norm_`` before ``step()`` works as well.
    cover_cpu_update
        zenflow's own (default False): with ``update_interval="auto"`` and ``overlap_step``, every
        interval is also long enough for the last CPU update (its NVMe state file's time
        included) to finish within the next one, as measured (``metrics()["interval_floor"]``);
        timing-dependent, so two runs may end their intervals at different steps.
    zenflow_config
        a DeepSpeed config (dict or JSON path) or its ``zenflow`` block; see
        :func:`zenflow.torch.deepspeed_options`. Explicit arguments must agree with it; one left at
        its default (or given as the default) takes the config's value.
    submit_in_backward
        False (default): ``step()`` hands every ``.grad`` over as it is then, after whatever
        accumulated, scaled, unscaled or clipped it. True: each gradient is handed over from
        ``register_post_accumulate_grad_hook`` as backward produces it, so that its offload
        overlaps backward; ``step()`` then checks (identity and version counter) that nothing
        changed a gradient after it was handed over, and if something did, it drops the step's
        hand-overs, hands the gradients over again as they are and warns once, naming the parameter.
    gradient_accumulation_steps
        with ``submit_in_backward``, the backward passes per step: gradients are handed over
        during the last one (an earlier hand-over would be dropped again). No effect otherwise;
        correctness never depends on it (accepted from DeepSpeed configs).
    cpu_threads, record_trace
        the size of the CPU Adam's thread pool and of the pool that accumulates the offloaded
        gradients (two pools: an interval's update overlaps the next one's accumulation; 0: every
        core this process may use, reserved ones aside); keep a record per CPU update (:meth:`trace`).
    reserved_cpus
        CPUs left to the training loop: the first ``reserved_cpus`` of the CPUs this process may
        run on (``os.sched_getaffinity``) run none of the optimizer's compute threads (its CPU Adam
        and the accumulation of offloaded gradients), so that a trainer bound by its own threads
        (Python launching GPU kernels) does not compete with the CPU update. 0 (default): none. A
        DeepSpeed config's ``zenflow.pt_reserved_cores_perc`` sets it (that fraction, rounded up).
    cpu_state
        how the CPU columns' Adam moments are held: ``"fp32"`` (default; 16 bytes per parameter
        with the fp32 master), ``"bf16_moments"`` (12 bytes) or ``"blockwise8_moments"`` (about
        10 bytes); both compact formats compute in fp32 and round stochastically. The fp32 master
        is kept in every format, and ``state_dict()`` holds the moments as fp32 tensors, so a
        checkpoint loads into an optimizer of any ``cpu_state``.
    offload_optimizer, aio
        the NVMe state tier, as DeepSpeed's ``zero_optimization.offload_optimizer`` and ``aio``
        blocks: ``offload_optimizer={"device": "nvme", "nvme_path": "/mnt/nvme/zenflow"}`` keeps
        the CPU columns' fp32 master and Adam moments in one preallocated O_DIRECT file per rank
        in that directory (a CRC32C per block, verified on every read) and streams them through
        the CPU Adam in blocks (read ahead, update, write behind); RAM keeps the gradient
        accumulator (4 bytes per parameter, 8 with overlap_step, instead of 16 or 20) and a pool
        of ``buffer_count`` blocks (``"master_on_disk": False`` keeps the master in RAM: 4 bytes
        more). Any ``cpu_state`` (on disk per parameter: fp32 12 bytes, bf16 8, 8-bit about 6, or
        8, 4 and about 2 with the master in RAM). Results are bit-identical to the same state in RAM.
        Other keys:
        buffer_count, pin_memory, pipeline_read, pipeline_write, io_engine ("auto", "io_uring",
        "posix"), master_on_disk; aio:
        block_size, queue_depth, intra_op_parallelism / thread_count (see
        :func:`zenflow.torch.nvme_config`). :attr:`nvme_status` names the engine in use;
        ``metrics()`` reports each CPU update's disk bytes and wait.
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

    ``params`` may be ``model.parameters()``, ``model.named_parameters()`` (errors then name each
    parameter by its module path) or parameter groups of either.

    Columns: the importance selector scores *columns* (input channels) of 2-D parameters. With
    ``column_dim=1`` (default; ``nn.Linear.weight`` [out, in]) column j is ``W[:, j]``; with
    ``column_dim=0`` (``nn.Embedding.weight`` [num, dim], see :func:`param_groups`) column j is
    the embedding ``W[j, :]``. Parameters with more dimensions are seen as
    ``[size(0), numel / size(0)]``; 1-D (and 0-D) parameters are always updated on the device.
    ``mode="zero_offload"`` selects no column, so it registers every 2-D parameter with
    ``column_dim=0`` whatever its group says: its columns, moved to the CPU and back every step,
    are then contiguous rows, copied rather than transposed.

    Parameters must be float32/bfloat16/float16 tensors with storage of their own, dense in memory
    (contiguous, channels_last, or a transposed matrix: the optimizer sees a parameter with its
    dimensions in memory order, so the columns of a channels_last weight are numbered in that
    order, and its ``state_dict()`` loads only into parameters in the same layout), all on the CPU
    or all on one CUDA device. The optimizer registers them (their values become the fp32 master)
    at the first ``step()``. Edit them in place whenever you like (``p.clamp_()``,
    ``nn.init``, ``model.load_state_dict``): the next ``step()`` (or :meth:`flush`,
    :meth:`state_dict`) adopts the edit; do not replace a parameter's ``.data``.

    With ``overlap_step`` the CPU columns' update of an interval reaches the parameters up to one
    interval later; call :meth:`flush` before evaluating or saving the model's weights.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, *,
                 amsgrad=False, maximize=False, foreach=None, capturable=False, differentiable=False, fused=None,
                 mode=None, topk_ratio=None, select_strategy=None,
                 select_interval=None, update_interval=None, full_warm_up_rounds=None, overlap_step=None,
                 steps_per_epoch=None, auto_select_steps=None, max_update_interval=None, max_grad_norm=None,
                 cover_cpu_update=None, zenflow_config=None, gradient_accumulation_steps=1, submit_in_backward=False, cpu_threads=0,
                 reserved_cpus=0, record_trace=False, column_dim=1, process_group=None, timeout=600.0, cpu_state="fp32",
                 offload_optimizer=None, aio=None):
        _check_unsupported({"amsgrad": amsgrad, "maximize": maximize, "capturable": capturable,
                            "differentiable": differentiable}, "")
        for key, value in (("foreach", foreach), ("fused", fused)):
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{key}: must be None, True or False, got {value!r}")
        given = {"mode": mode, "topk_ratio": topk_ratio, "select_strategy": select_strategy,
                 "select_interval": select_interval, "update_interval": update_interval,
                 "full_warm_up_rounds": full_warm_up_rounds, "overlap_step": overlap_step,
                 "steps_per_epoch": steps_per_epoch, "auto_select_steps": auto_select_steps,
                 "max_update_interval": max_update_interval, "max_grad_norm": max_grad_norm,
                 "cover_cpu_update": cover_cpu_update}
        adam = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay,
                "gradient_accumulation_steps": gradient_accumulation_steps}
        if zenflow_config is not None:
            torch_defaults = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2,
                              "gradient_accumulation_steps": 1}
            for key, value in deepspeed_options(zenflow_config).items():
                if key == "cpu_state":
                    if cpu_state != "fp32" and cpu_state != value:
                        raise ValueError(f"cpu_state: {cpu_state!r} contradicts zenflow_config's {value!r}")
                    cpu_state = value
                elif key == "reserved_cpus":
                    if reserved_cpus != 0 and reserved_cpus != value:
                        raise ValueError(f"reserved_cpus: {reserved_cpus!r} contradicts zenflow_config's "
                                         f"pt_reserved_cores_perc ({value} CPUs)")
                    reserved_cpus = value
                elif key in ("offload_optimizer", "aio"):
                    mine = offload_optimizer if key == "offload_optimizer" else aio
                    if mine is not None and mine != value:
                        raise ValueError(f"{key}: {mine!r} contradicts zenflow_config's {value!r}")
                    if key == "offload_optimizer":
                        offload_optimizer = value
                    else:
                        aio = value
                elif key in given:
                    if given[key] is not None and given[key] != value:
                        raise ValueError(f"{key}: {given[key]!r} contradicts zenflow_config's {value!r}")
                    given[key] = value
                else:
                    if not _same(adam[key], torch_defaults[key]) and not _same(adam[key], value):
                        raise ValueError(f"{key}: {adam[key]!r} contradicts zenflow_config's {value!r}")
                    adam[key] = value
        self._method = method_options(given)
        steps = adam["gradient_accumulation_steps"]
        if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= INT64_MAX:
            raise ValueError(f"gradient_accumulation_steps: must be an integer in [1, {INT64_MAX}], got {steps!r}")
        if isinstance(cpu_threads, bool) or not isinstance(cpu_threads, int) or not 0 <= cpu_threads <= 4096:
            raise ValueError(f"cpu_threads: must be an integer in [0, 4096] (0: every core), got {cpu_threads!r}")
        cpus = usable_cpus()
        if isinstance(reserved_cpus, bool) or not isinstance(reserved_cpus, int) or not 0 <= reserved_cpus < cpus:
            raise ValueError(f"reserved_cpus: must be an integer in [0, {cpus - 1}] (this process may run on {cpus} "
                             f"CPUs and the optimizer's threads need one), got {reserved_cpus!r}")
        if not isinstance(record_trace, bool):
            raise ValueError(f"record_trace: must be True or False, got {record_trace!r}")
        if cpu_state not in CPU_STATES:
            raise ValueError(f"cpu_state: must be one of {', '.join(map(repr, CPU_STATES))}, got {cpu_state!r}")
        nvme = nvme_config(offload_optimizer, aio)
        if nvme is not None:
            # Absolute now: a relative path means the working directory at construction, not at the
            # first step (when the state file is created).
            nvme["directory"] = os.path.abspath(nvme["directory"])
            if not os.path.isdir(nvme["directory"]):
                raise ValueError(f"offload_optimizer.nvme_path: {nvme['directory']!r} is not a directory (create it "
                                 f"on the SSD first)")
            try:  # what the state file checks when the first step creates it, now
                _C.check_state_directory(nvme["directory"])
            except _C.ZenFlowError as e:
                raise ValueError(f"offload_optimizer.nvme_path: {e}") from None
        if not isinstance(submit_in_backward, bool):
            raise ValueError(f"submit_in_backward: must be True or False, got {submit_in_backward!r}")
        if hasattr(timeout, "total_seconds"):
            timeout = timeout.total_seconds()
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 1e9:
            raise ValueError(f"timeout: must be a number of seconds in (0, 1e9] or a timedelta, got {timeout!r}")
        defaults = {"lr": adam["lr"], "betas": adam["betas"], "eps": adam["eps"],
                    "weight_decay": adam["weight_decay"], "column_dim": column_dim}
        _check_hyper(defaults, "")
        # Every option as the coordinator will check it, now rather than at the first step.
        _C.validate_options(dict(self._method, adam=_adam(defaults)))
        self.gradient_accumulation_steps = steps
        self.submit_in_backward = submit_in_backward
        self._config = {"cpu_threads": cpu_threads, "pin_threads": False, "reserved_cpus": reserved_cpus,
                        "d2h_slot_bytes": 4 << 20, "d2h_slots": 4, "h2d_slot_bytes": 4 << 20, "h2d_slots": 2,
                        "record_trace": record_trace, "cpu_state": cpu_state, "nvme": nvme}
        self._timeout = float(timeout)
        self._core = None
        self._closed = False
        self._hooks = []
        self._process_group = process_group
        self._own_group = None
        self._params = []        # every parameter it trains (registered with the core), in group order
        self._names = []         # its module path (named parameters) or param_groups[g].params[k]
        self._members = []       # per group, the indices in _params of its parameters
        self._frozen = []        # (group, position, parameter, name): frozen when added, never registered
        self._handed = {}        # parameter index -> (gradient, its version) handed over in backward
        self._rehand = False     # this step's gradients go over in step() (a hand-over was dropped)
        self._warned = False
        self._backward_count = []
        self._versions = []      # each parameter's version counter when the optimizer last wrote it
        self._metrics = {}
        self._last_gradients = None  # the last step's {"skipped", "grad_norm"}, once asked
        self._pushed = None
        super().__init__(params, defaults)  # calls add_param_group per group
        _open.add(self)
        if process_group is not None:
            self._built()  # collective: every rank registers now, from the first rank's values

    @classmethod
    def from_deepspeed(cls, params, config, **kwargs):
        """The optimizer a DeepSpeed config describes (see :func:`zenflow.torch.deepspeed_options`)."""
        return cls(params, zenflow_config=config, **kwargs)

    # -- torch.optim.Optimizer ----------------------------------------------------------------

    def add_param_group(self, param_group):
        """torch's add_param_group, before the first ``step()``. A group that is rejected (a bad
        value, a parameter of an unsupported kind or sharing memory with another) is not added."""
        if self._core is not None:
            raise ValueError("add_param_group: parameters must be added before the first step() (they are "
                             "registered with the library then)")
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group: must be a dict, got {type(param_group).__name__}")
        gi = len(self.param_groups)
        super().add_param_group(param_group)
        g = self.param_groups[gi]
        try:
            _check_hyper(g, f"param_groups[{gi}].")
            names = g.get("param_names")
            all_names = [names[k] if names else f"param_groups[{gi}].params[{k}]" for k in range(len(g["params"]))]
            # A parameter frozen now (requires_grad False: a PEFT/LoRA base weight, a frozen
            # encoder) is never registered: torch.optim.AdamW keeps no state for a parameter
            # without gradients, and registering it would hold its CPU state all the same.
            trained = [k for k, q in enumerate(g["params"]) if q.requires_grad]
            new_names = [all_names[k] for k in trained]
            self._check_params([g["params"][k] for k in trained], new_names)
        except Exception:
            del self.param_groups[gi:]
            raise
        start = len(self._params)
        self._params.extend(g["params"][k] for k in trained)
        self._names.extend(new_names)
        self._members.append(list(range(start, len(self._params))))
        self._frozen.extend((gi, k, q, all_names[k]) for k, q in enumerate(g["params"]) if not q.requires_grad)
        self._backward_count.extend([0] * len(trained))
        if self.submit_in_backward:
            ref = weakref.ref(self)
            for i in range(start, len(self._params)):  # each requires grad, so each takes a hook
                self._hooks.append(self._params[i].register_post_accumulate_grad_hook(_hook(ref, i)))

    def zero_grad(self, set_to_none=True):
        """torch's zero_grad; also drops the gradients handed over during backward that no step()
        consumed (an iteration interrupted between backward and step)."""
        self._drop_hand_overs()
        self._rehand = False
        self._backward_count = [0] * len(self._params)
        super().zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self, closure=None):
        """Ends the training step with the gradients in ``.grad`` now (a parameter whose ``.grad``
        is None is skipped, as torch.optim.AdamW skips it): adopts the parameters edited since the
        optimizer last wrote them, then runs the coordinator's step (device update of the selected
        columns and 1-D parameters, offload of the rest, the CPU schedule). Returns the closure's
        loss. A step rejected for its input (a bad value, a changed parameter, a gradient that does
        not fit; ValueError) or because the data-parallel ranks disagree on which parameters got
        gradients (ZenFlowError) changes nothing. A failure of the optimizer's own work (a disk
        error in the NVMe tier, a collective that times out) raises ZenFlowError and leaves the
        optimizer failed: that step may have updated part of the parameters, and every later call
        raises the same error."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_group_params()
        core = self._built()
        # Named ranges for torch.profiler (they cost a few microseconds per step when it is off).
        with record_function("zenflow: check"):  # everything first
            for i, p in enumerate(self._params):
                self._check_storage(i)
                if p.grad is not None:
                    self._check_grad(i, p.grad, strided_ok=True)
            for gi, g in enumerate(self.param_groups):
                _check_hyper(g, f"param_groups[{gi}].")
            changes = self._hyper_changes()
        stream = self._stream()
        with record_function("zenflow: adopt edits"):
            self._adopt_edits(core, stream)
        self._verify_hand_overs()
        for gi, adam in changes:
            for i in self._members[gi]:
                core.set_adam_options(i, adam)
            self._pushed[gi] = adam
        try:
            # A gradient laid out otherwise than its parameter (a transposed one, autograd's expanded
            # ones) goes over as a copy in the parameter's layout, which lives until the step's work
            # on the stream has read it (torch's caching allocator reuses its memory for later work
            # on that stream only).
            copies = []
            with record_function("zenflow: submit"):
                for i, p in enumerate(self._params):
                    if p.grad is not None and i not in self._handed:
                        copies.append(self._core_grad(i, p.grad))
                        core.submit(i, copies[-1], stream)
            with record_function("zenflow: coordinator step"):
                self._metrics = core.step(stream)
            self._last_gradients = None
            if self._device().type == "cpu":  # the step's statistics are done: no wait to ask
                self._last_gradients = core.last_step_gradients()
                if self._last_gradients["skipped"]:
                    warnings.warn(f"ZenFlowAdamW: step {self._metrics['step']} skipped: a gradient holds a NaN or "
                                  f"an infinity (none of its gradients was applied; a CPU update of earlier "
                                  f"steps due at this step is written back all the same; metrics()['skipped'] "
                                  f"reports every step)",
                                  RuntimeWarning, stacklevel=2)
        except Exception:
            try:  # a step() that rejects its input dropped them already; a rejected submit did not
                core.discard_gradients(stream)
            except Exception:  # noqa: BLE001 -- a failed coordinator: the first error goes on
                pass
            raise
        finally:
            # Consumed, or dropped by the coordinator (a rejected step drops the step's gradients).
            self._handed = {}
            self._rehand = False
            self._backward_count = [0] * len(self._params)
        with record_function("zenflow: record versions"):
            self._record_versions()
        return loss

    def _checkpoint_dir(self):
        """A temporary directory for a checkpoint file on its way to or from the core: in the NVMe
        tier's directory when there is one (a disk, where the state is; /tmp may be RAM)."""
        nvme = self._config["nvme"]
        return tempfile.TemporaryDirectory(prefix="zenflow-", dir=nvme["directory"] if nvme else None)

    def state_dict(self):
        """torch's state dict (param groups) plus ``"zenflow"``: the optimizer state (as
        torch.optim's, it holds no parameter values: save the model's ``state_dict()`` too). Per
        element: the moments (8 bytes) and, for a bfloat16/float16 parameter, its fp32 master (4);
        within an interval the CPU columns' accumulated gradient (4) and with ``overlap_step`` their
        pending result (the parameter's dtype). Pending CPU work stays pending: a run resumed from
        it continues bit-identically. Adopts edited parameters first, as step() does.

        The entry's tensor maps a temporary file (removed already; its space is freed with the
        tensor) in the NVMe tier's directory, or in the system's temporary directory: saving
        costs disk space, not host memory, so a state larger than RAM can be saved."""
        if self._closed:
            raise ValueError("state_dict: the optimizer is closed (close() freed its state); call state_dict() "
                             "before close()")
        sd = super().state_dict()
        checkpoint = None
        if self._core is not None:
            stream = self._stream()
            self._adopt_edits(self._core, stream)
            self._drop_hand_overs()  # step() hands those gradients over again
            with self._checkpoint_dir() as d:
                path = os.path.join(d, "checkpoint.zf")
                self._core.save(path, stream, "optimizer_state")
                # A tensor: torch.save writes its bytes as they are (pickle's protocol 2 would
                # write a bytes object as latin-1 text, half again as large). It maps the file
                # rather than reading it: the state is most of the host's memory (or more than
                # it, on an SSD), and torch.save reads the file's pages through the page cache.
                checkpoint = torch.from_file(path, shared=False, size=os.path.getsize(path), dtype=torch.uint8)
        sd["zenflow"] = {"format": _CHECKPOINT_FORMAT, "checkpoint": checkpoint, "mode": self._method["mode"]}
        if checkpoint is not None:  # the parameters not contiguous: the state follows their memory order
            sd["zenflow"]["memory_orders"] = [[i, list(o)] for i, o in enumerate(self._orders) if o is not None]
        if self._method["mode"] == "zero_offload":
            sd["zenflow"]["columns"] = _ZERO_OFFLOAD_COLUMNS
        return sd

    def load_state_dict(self, state_dict):
        """Restores a state dict from :meth:`state_dict` of an optimizer with the same options and
        parameters. As with torch.optim, the parameters' values are the model's: load the model's
        ``state_dict()`` first (loaded afterwards, they count as an edit, see :meth:`step`).
        Rejected, with nothing changed, if it does not match."""
        if self._closed:
            raise ValueError("load_state_dict: the optimizer is closed")
        if not isinstance(state_dict, dict):
            raise ValueError(f"state_dict: must be a dict (from state_dict()), got {type(state_dict).__name__}")
        state_dict = dict(state_dict)
        zf = state_dict.pop("zenflow", None)
        if not isinstance(zf, dict) or zf.get("format") != _CHECKPOINT_FORMAT:
            found = zf.get("format") if isinstance(zf, dict) else None
            hint = (" torch.distributed.checkpoint's get_optimizer_state_dict drops that entry: save "
                    "optimizer.state_dict() itself" if zf is None else "")
            raise ValueError(f"state_dict: has no zenflow checkpoint of format {_CHECKPOINT_FORMAT} (found "
                             f"{found!r}; was it written by this version's ZenFlowAdamW.state_dict?){hint}")
        if zf.get("mode") != self._method["mode"]:
            raise ValueError(f"state_dict: was written in mode {zf.get('mode')!r}, this optimizer runs "
                             f"{self._method['mode']!r}")
        if self._method["mode"] == "zero_offload" and zf.get("columns") != _ZERO_OFFLOAD_COLUMNS:
            raise ValueError("state_dict: was written by a zenflow.torch whose zero_offload mode saw a weight's "
                             "columns as its input channels; this one registers every 2-D parameter with "
                             "column_dim=0 in that mode (no transposes), so the state is laid out differently: "
                             "resume it with the version that wrote it")
        checkpoint = zf.get("checkpoint")
        if isinstance(checkpoint, torch.Tensor) and checkpoint.dtype == torch.uint8 and checkpoint.dim() == 1:
            checkpoint = checkpoint.cpu()  # (accelerate may have moved it to the device)
        elif checkpoint is not None and not isinstance(checkpoint, (bytes, bytearray)):
            raise ValueError(f"state_dict['zenflow']['checkpoint']: must be a 1-D uint8 tensor (as state_dict() "
                             f"wrote it) or bytes, got {type(checkpoint).__name__}")
        orders = zf.get("memory_orders", [])
        try:
            saved_orders = {int(i): tuple(int(d) for d in o) for i, o in orders}
        except (TypeError, ValueError):
            raise ValueError(f"state_dict['zenflow']['memory_orders']: must be [index, order] pairs (as state_dict() "
                             f"wrote them), got {orders!r}") from None
        saved = state_dict.get("param_groups")
        if not isinstance(saved, list) or len(saved) != len(self.param_groups):
            raise ValueError(f"state_dict: has {len(saved) if isinstance(saved, list) else 'no'} parameter groups, "
                             f"this optimizer {len(self.param_groups)}")
        for gi, (g, s) in enumerate(zip(self.param_groups, saved)):
            if not isinstance(s, dict):
                raise ValueError(f"state_dict: param_groups[{gi}] is a {type(s).__name__}, not a dict")
            merged = dict(g, **{k: v for k, v in s.items() if k != "params"})
            _check_hyper(merged, f"param_groups[{gi}].")
            if s.get("column_dim", 1) != g.get("column_dim", 1):
                raise ValueError(f"state_dict: param_groups[{gi}].column_dim is {s.get('column_dim', 1)!r}, this "
                                 f"optimizer's {g.get('column_dim', 1)!r}")
        old_groups, old_state = self.param_groups, self.state  # torch replaces both
        # The old core's view of the trainer's tensors: the versions it last wrote (an in-place
        # edit since then, such as a model.load_state_dict rollback, is still to be adopted by it)
        # and the gradients handed over to it during backward. Building the new core re-records
        # the versions: a rejected load puts all of it back.
        old_versions, old_handed, old_rehand = list(self._versions), self._handed, self._rehand
        super().load_state_dict(state_dict)
        old_core, old_pushed = self._core, self._pushed
        try:
            self._core = None
            if checkpoint is not None:
                core = self._built()
                self._check_memory_orders(saved_orders)
                with self._checkpoint_dir() as d:
                    path = os.path.join(d, "checkpoint.zf")
                    with open(path, "wb") as f:  # the tensor's memory as it is, not a copy of it
                        f.write(memoryview(checkpoint.contiguous().numpy()) if isinstance(checkpoint, torch.Tensor)
                                else checkpoint)
                    # By position, as torch.optim's load_state_dict: a model wrapped since the
                    # save (torch.compile, DDP) or a module renamed has other names.
                    core.load(path, self._stream(), "positions")
                # The checkpoint brings back each parameter's lr, betas, eps and weight_decay as they were
                # when it was saved; the loaded param_groups are what the next step uses (torch's
                # rule: a scheduler saved one step ahead, or a group edited in the state dict).
                for gi, g in enumerate(self.param_groups):
                    adam = _adam(g)
                    for i in self._members[gi]:
                        core.set_adam_options(i, adam)
                    self._pushed[gi] = adam
        except Exception:
            if self._core is not None:
                self._core.close()
            self._core, self._pushed = old_core, old_pushed
            self.param_groups, self.state = old_groups, old_state
            self._versions, self._handed, self._rehand = old_versions, old_handed, old_rehand
            raise
        if old_core is not None:
            old_core.close()
        self._handed = {}
        self._rehand = False
        self._backward_count = [0] * len(self._params)
        self._record_versions()

    def _check_memory_orders(self, saved):
        """A checkpoint's state is laid out in each parameter's memory order: a parameter converted
        to or from channels_last since would take its state on other elements. Rejected, naming it."""
        def layout(order):
            if order is None:
                return "contiguous"
            return "transposed" if order == (1, 0) else f"laid out in memory in dimension order {order}"
        for i, order in enumerate(self._orders):
            if saved.get(i) != order:
                raise ValueError(f"state_dict: {self._names[i]} was {layout(saved.get(i))} when the state was saved "
                                 f"and is {layout(order)} now (a model converted to or from channels_last since?): "
                                 f"its optimizer state would land on other elements; convert the model to the memory "
                                 f"format it was saved in first")
        extra = sorted(k for k in saved if not 0 <= k < len(self._orders))
        if extra:
            raise ValueError(f"state_dict: names parameter {extra[0]} in memory_orders; this optimizer has "
                             f"{len(self._orders)} parameters")

    def __deepcopy__(self, memo):
        raise TypeError("ZenFlowAdamW cannot be copied: its state lives in the library's coordinator (worker "
                        "threads, pinned buffers). Build a new ZenFlowAdamW over the copied model's parameters and "
                        "load_state_dict(opt.state_dict()) into it")

    def __getstate__(self):
        raise TypeError("ZenFlowAdamW cannot be pickled: its state lives in the library's coordinator. Save "
                        "opt.state_dict() (torch.save takes it) and load it into a new ZenFlowAdamW")

    # -- zenflow --------------------------------------------------------------------------------

    def metrics(self):
        """The last step's step_metrics as a dict: stall_seconds, stall_reason, cpu_update_seconds,
        bytes_device_to_host, bytes_host_to_device, selection_overlap, interval, reselected,
        cpu_update_launched, written_back, step; with the NVMe tier the last CPU update's
        cpu_update_disk_read_bytes, cpu_update_disk_written_bytes and cpu_update_disk_wait_seconds
        (0 with the state in RAM). After a step, also ``skipped`` (a gradient held a NaN or an
        infinity, so the step updated nothing; on CPU tensors step() also warns) and ``grad_norm``
        (the global norm of the gradients before ``max_grad_norm`` clipping, of their finite
        elements when skipped). On CUDA tensors those two wait for the step's gradient statistics
        on the device (not for the rest of its work)."""
        out = dict(self._metrics)
        if self._core is not None and out:
            if self._last_gradients is None:
                try:
                    self._last_gradients = self._core.last_step_gradients()
                except Exception:  # noqa: BLE001 -- a failed coordinator: the rest is still reported
                    pass
            if self._last_gradients is not None:
                out.update(self._last_gradients)
        return out

    def trace(self):
        """One dict per CPU update (interval, first_step, last_step, accumulated_steps,
        written_back_at, write_backs, synchronous); needs ``record_trace=True``."""
        return self._core.trace() if self._core is not None else []

    def gpu_columns(self, param):
        """Columns of ``param`` (a tensor of this optimizer) updated on the device now."""
        i = self._index_of(param)
        return self._core.gpu_columns(i) if self._core is not None else []

    def owned_columns(self, param):
        """(first, last): the columns of 2-D ``param`` whose CPU state this rank holds (all of them
        in one process; 1/N of them per rank with a process group). (0, 0) for a 1-D one. Columns
        as registered: in ``zero_offload`` mode those of ``column_dim=0`` (rows of ``param``)."""
        i = self._index_of(param)
        return tuple(self._built().owned_columns(i))

    @property
    def options(self):
        """The method's options in effect (DeepSpeed's names)."""
        return dict(self._method)

    @property
    def cpu_state(self):
        """How the CPU columns' moments are held: "fp32", "bf16_moments" or "blockwise8_moments"."""
        return self._config["cpu_state"]

    @property
    def nvme(self):
        """The NVMe state tier's settings (a dict: directory, block_bytes, read_ahead, write_behind,
        pin, engine, queue_depth, threads), or None with the state in RAM."""
        return None if self._config["nvme"] is None else dict(self._config["nvme"])

    @property
    def nvme_status(self):
        """One line on the state file: its path, O_DIRECT, the I/O engine in use (and why, when
        chosen automatically) and the pool's pinning. "" with the state in RAM; None before the
        first step() builds the optimizer's state."""
        return None if self._core is None else self._core.nvme_status()

    def host_memory(self):
        """The bytes this optimizer holds for its CPU columns, by what they are for (a dict):
        cpu_state (the CPU optimizer's state in RAM), accumulators (the fp32 gradient
        accumulators), copy_out (the CUDA backend's copy-out window), state_file_pool (the NVMe
        tier's pool), device_buffers (the write-back staging and gathered gradients: GPU memory
        with CUDA tensors, RAM with CPU tensors) and host_total (RAM with CUDA tensors: every entry
        but device_buffers). Waits for the CPU updates already launched. None before the first
        step() builds the optimizer's state. The parameters, their gradients and the device's
        optimizer state are not counted."""
        return None if self._core is None else self._core.host_memory()

    def flush(self):
        """Completes all CPU work and writes it into the parameters (before evaluating or saving
        the model's weights); training may go on. Adopts edited parameters first. Synchronizes."""
        if self._core is not None:
            stream = self._stream()
            self._adopt_edits(self._core, stream)
            self._core.finish(stream)  # drops gradients handed over since the last step
            self._handed = {}          # step() hands them over again from .grad
            self._record_versions()

    def close(self):
        """flush(), then stops the coordinator's threads and frees its state. Idempotent; also
        called at interpreter exit and by ``with``."""
        if self._closed:
            return
        try:
            if self._core is not None:
                self.flush()
        finally:
            self._release()

    def abort(self, reason):
        """Ends the optimizer without completing its pending CPU work, and with ``process_group``
        fails the group's collectives on every rank at once with ``reason`` (what a rank leaving
        on an error of its own should do: its peers would otherwise wait for ``timeout``). Then as
        close(), but nothing is flushed. Idempotent."""
        if self._closed:
            return
        try:
            if self._core is not None:
                self._core.abort(str(reason))
        finally:
            self._release()

    def _release(self):
        """close() and abort(): the hooks removed, the coordinator's threads stopped, its state freed."""
        self._closed = True
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._core is not None:
            self._core.close()
            self._core = None
        self._handed = {}
        _open.discard(self)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        # Leaving on an exception with process_group: abort (flush() is a collective the peers
        # would not join), naming it; else close().
        if exc_type is not None and self._process_group is not None:
            self.abort(f"left a `with ZenFlowAdamW(...)` block on {exc_type.__name__}: {exc}")
        else:
            self.close()
        return False

    def __del__(self):
        # As close(): pending CPU work reaches the parameters (an optimizer dropped without close()
        # would otherwise lose its last CPU update). A failure there cannot be raised from here:
        # it is reported as a warning and the state freed.
        if getattr(self, "_core", None) is None or getattr(self, "_closed", True):
            return
        try:
            self.close()
        except Exception as e:  # noqa: BLE001 -- __del__ must not raise
            warnings.warn(f"ZenFlowAdamW: garbage-collected without close(), and its flush failed ({e}); the "
                          f"parameters may miss the last CPU update", RuntimeWarning, stacklevel=2)
            core = getattr(self, "_core", None)
            if core is not None:
                core.close()
                self._core = None

    # -- internals ------------------------------------------------------------------------------

    def _index_of(self, param):
        for i, p in enumerate(self._params):
            if p is param:
                return i
        if any(p is param for _, _, p, _ in self._frozen):
            raise ValueError("param: was frozen (requires_grad False) when it was added: the optimizer does not "
                             "train it")
        raise ValueError("param: not a parameter of this optimizer")

    def _check_params(self, new, names, others=None):
        """Checks parameters about to join the optimizer, against each other and `others` (the
        optimizer's parameters and names, by default)."""
        others_params, others_names = (self._params, self._names) if others is None else others
        devices = {p.device for p in others_params}
        for p, name in zip(new, names):
            if not isinstance(p, torch.Tensor):
                raise ValueError(f"params: {name} is a {type(p).__name__}, not a tensor")
            if p.is_sparse or p.layout != torch.strided:
                raise ValueError(f"params: {name} is not a dense tensor ({p.layout})")
            if p.dtype not in _DTYPES:
                raise ValueError(f"params: {name} has dtype {p.dtype}; supported: float32, bfloat16, float16")
            if _memory_order(p) is False:
                raise ValueError(f"params: {name} is not dense in memory (shape {tuple(p.shape)}, strides "
                                 f"{tuple(p.stride())}: a slice or an expanded view); a parameter must be laid out "
                                 f"without gaps or overlap, contiguous, in a channels_last format or as a "
                                 f"transposed matrix")
            if p.numel() == 0:
                raise ValueError(f"params: {name} is empty")
            if p.device.type not in ("cpu", "cuda"):
                raise ValueError(f"params: {name} is on {p.device}; supported: cpu, cuda")
            if p.device.type == "cuda" and not _C.with_cuda:
                raise ValueError(f"params: {name} is a CUDA tensor, but zenflow.torch was built without its "
                                 f"CUDA backend: {_C.cuda_reason}")
            devices.add(p.device)
        if len(devices) > 1:
            raise ValueError(f"params: all parameters must be on one device, got "
                             f"{', '.join(sorted(map(str, devices)))}")
        # The coordinator updates each parameter's memory in place: no two may overlap.
        spans = [(p.data_ptr(), p.data_ptr() + p.numel() * p.element_size(), p, name)
                 for p, name in zip(list(others_params) + list(new), list(others_names) + list(names))]
        spans.sort(key=lambda s: s[0])
        for (a0, a1, a, an), (b0, b1, b, bn) in zip(spans, spans[1:]):
            if b0 < a1:
                if a is b:
                    raise ValueError(f"params: {an} is given twice")
                raise ValueError(f"params: {an} and {bn} share storage (one is a view of the other, or both of "
                                 f"one tensor); each parameter must own its memory. Tied weights: give the one "
                                 f"shared Parameter once")

    def _check_storage(self, i):
        if self._core is not None and self._params[i].data_ptr() != self._data_ptrs[i]:
            p = self._params[i]
            raise ValueError(f"params: {self._names[i]}'s storage was replaced after the first step (param.data = "
                             f"..., or a module's .to()/.half() conversion; it is now {tuple(p.shape)} "
                             f"{p.dtype}): the optimizer updates the memory it registered. Change the values in "
                             f"place instead (with torch.no_grad(): param.copy_(new)), or build a new optimizer")

    def _check_grad(self, i, grad, strided_ok=False):
        """`strided_ok`: a gradient laid out otherwise than its parameter is accepted (step() hands a
        copy in the parameter's layout over)."""
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
        if not strided_ok and not self._core_layout(i, grad).is_contiguous():
            raise ValueError(f"grad: {name}'s gradient is not laid out in memory as its parameter is")

    def _order(self, i):
        """The memory order parameter i is (or will be) registered in, None for a contiguous one (or
        one in no such order, which the first step() rejects)."""
        if self._core is not None:
            return self._orders[i]
        return _memory_order(self._params[i]) or None

    def _core_layout(self, i, t):
        """Tensor `t` shaped as parameter i (its value, its gradient) with its dimensions in the
        parameter's memory order: a contiguous view when `t` is laid out as the parameter is."""
        order = self._order(i)
        return t if order is None else t.permute(order)

    def _core_grad(self, i, grad):
        """`grad` as the core reads parameter i's gradient: a view, or a copy in the parameter's
        layout when its strides differ."""
        g = self._core_layout(i, grad)
        return g if g.is_contiguous() else g.contiguous()

    def _grad_ok(self, i, grad):
        try:
            self._check_storage(i)
            self._check_grad(i, grad)
        except ValueError:
            return False
        return True

    def _device(self):
        return self._params[0].device if self._params else torch.device("cpu")

    def _stream(self):
        d = self._device()
        return torch.cuda.current_stream(d).cuda_stream if d.type == "cuda" else 0

    def _check_group_params(self):
        """torch.optim steps whatever param_groups hold at step time; ZenFlowAdamW registers its
        parameters as they are added: a group's list edited since (a parameter appended, removed or
        replaced) is rejected, before anything changes. So is a gradient on a parameter that was
        frozen when it was added (never registered: it has no state here)."""
        k, f = 0, 0  # the registered parameters and the frozen ones, in the groups' order
        for gi, g in enumerate(self.param_groups):
            for j, p in enumerate(g["params"]):
                if f < len(self._frozen) and self._frozen[f][:2] == (gi, j) and self._frozen[f][2] is p:
                    f += 1
                    continue
                if k == len(self._params) or p is not self._params[k]:
                    raise self._edited_group(gi, j)
                k += 1
        if k < len(self._params) or f < len(self._frozen):  # parameters removed at the end
            gi = max(len(self.param_groups) - 1, 0)
            raise self._edited_group(gi, len(self.param_groups[gi]["params"]) if self.param_groups else 0)
        for gi, j, p, name in self._frozen:
            if p.grad is not None:
                raise ValueError(f"param_groups[{gi}]['params'][{j}] ({name}): has a gradient, but it was frozen "
                                 f"(requires_grad False) when it was added, so ZenFlowAdamW holds no state for it "
                                 f"(it registers its parameters when they are added; torch.optim.AdamW would create "
                                 f"the state now): unfreeze the parameters you will train before building the "
                                 f"optimizer, or build a new one")

    @staticmethod
    def _edited_group(gi, j):
        return ValueError(f"param_groups[{gi}]['params'][{j}]: the group's parameter list changed after it was "
                          f"added (a parameter appended, removed or replaced); ZenFlowAdamW registers its parameters "
                          f"as they are added: add new ones with add_param_group() before the first step(), or build "
                          f"a new optimizer")

    def _hyper_changes(self):
        """The groups whose hyper-parameters changed since they were last handed to the core (a
        schedule's lr, OneCycleLR's beta1, a group edited by hand), with their new values."""
        return [(gi, adam) for gi, adam in ((gi, _adam(g)) for gi, g in enumerate(self.param_groups))
                if adam != self._pushed[gi]]

    def _record_versions(self):
        self._versions = [p._version for p in self._params]

    def _adopt_edits(self, core, stream):
        """Parameters whose version counter moved since the optimizer last wrote them were edited
        (in place, by the user): their values become the fp32 master (the coordinator's rule)."""
        for i, p in enumerate(self._params):
            v = p._version
            if v != self._versions[i]:
                core.reload_parameter(i, stream)
                self._versions[i] = v

    def _drop_hand_overs(self):
        """Drops the gradients handed over during backward that no step consumed."""
        if self._handed and self._core is not None:
            self._core.discard_gradients(self._stream())
        self._handed = {}

    def _verify_hand_overs(self):
        """submit_in_backward: a gradient changed after its hand-over (version counter, identity)
        is handed over again, with the whole step's (the coordinator drops them all at once)."""
        if not self._handed and not self._rehand:
            return
        cause = None
        for i, (grad, version) in self._handed.items():
            now = self._params[i].grad
            if now is None:
                cause = (i, "was set to None")
            elif now is not grad:
                cause = (i, "is another tensor now (a further backward pass, or an assignment to .grad)")
            elif now._version != version:
                cause = (i, "was changed in place (clip_grad_norm_, GradScaler.unscale_, a further backward pass)")
            if cause:
                break
        if cause or self._rehand:
            self._drop_hand_overs()
            if cause and not self._warned:
                self._warned = True
                warnings.warn(f"grad: {self._names[cause[0]]}'s gradient {cause[1]} after it was handed over during "
                              f"backward (submit_in_backward=True): this step's gradients were handed over again, "
                              f"as they are now, which costs the overlap. Leave .grad unchanged between backward and "
                              f"step() (clip with max_grad_norm=...), or use submit_in_backward=False (the default). "
                              f"Warned once.", stacklevel=3)

    def _built(self):
        if self._closed:
            raise ValueError("optimizer: is closed")
        if self._core is not None:
            return self._core
        if not self._params:
            frozen = f" ({len(self._frozen)} were frozen when added: requires_grad False)" if self._frozen else ""
            raise ValueError(f"params: the optimizer has no parameters to train{frozen}")
        try:  # again: they are registered now, and a conversion since construction changes them
            self._check_params(self._params, self._names, others=([], []))
        except ValueError as e:
            raise ValueError(f"{e} (checked when the first step() registers the parameters: a conversion after "
                             f"the optimizer was built, such as model.double(), changes them)") from None
        for gi, g in enumerate(self.param_groups):
            _check_hyper(g, f"param_groups[{gi}].")
        adams = [_adam(g) for g in self.param_groups]
        options = dict(self._method, adam=adams[0])
        device = self._device()
        # Each parameter as the core sees it: its dimensions in memory order, a contiguous view of
        # its storage (a channels_last convolution weight, a transposed matrix).
        self._orders = [_memory_order(p) for p in self._params]  # dense: _check_params above
        if self._process_group is not None:
            core = self._data_parallel_core(options, device)
        elif device.type == "cuda":
            with torch.cuda.device(device):
                core = _C.Coordinator(options, self._core_config(), "cuda")
        else:
            core = _C.Coordinator(options, self._core_config(), "cpu")
        # The coordinator writes through the registered storage until it is closed: keep that
        # storage alive even if a parameter's .data is replaced (which step() then rejects).
        self._registered = [p.detach() if o is None else p.detach().permute(o)
                            for p, o in zip(self._params, self._orders)]
        try:
            for gi, g in enumerate(self.param_groups):
                for index in self._members[gi]:
                    name, view = self._names[index], self._registered[index]
                    if view.dim() >= 2:
                        k = core.add_matrix(name, view, self._registered_column_dim(g, self._orders[index]),
                                            adams[gi])
                    else:
                        k = core.add_vector(name, view, adams[gi])
                    assert k == index
        except Exception:
            core.close()
            raise
        self._data_ptrs = [p.data_ptr() for p in self._registered]
        self._pushed = adams
        self._core = core
        self._record_versions()
        # The state lives in the core; each parameter's torch-side entry stays an empty dict, so
        # that code which initializes an optimizer whose `state` is empty by stepping it once with
        # zero gradients (torch.distributed.checkpoint's get_optimizer_state_dict) sees one that
        # has state and does not add that step to the run.
        for p in self._params:
            self.state[p]  # noqa: B018 -- the defaultdict creates the entry
        return core

    def _registered_column_dim(self, group, order):
        """The column_dim a 2-D parameter of `group` laid out in `order` is registered with.
        ZeRO-Offload selects no column (every column is updated on the CPU each step), so which
        dimension holds the columns does not change a result; with column_dim=0 a column is a
        contiguous row of the tensor, and moving every column to the CPU and back is a plain copy
        instead of a transposition. A transposed matrix is registered as the contiguous view of
        its transpose, with the other column_dim: a column is the same elements either way."""
        column_dim = 0 if self._method["mode"] == "zero_offload" else int(group.get("column_dim", 1))
        return 1 - column_dim if order == (1, 0) else column_dim

    def _core_config(self):
        """The coordinator's config. With the NVMe tier, each coordinator this optimizer builds gets a
        state file of its own (load_state_dict builds the next one while it keeps the last for a
        rollback; several optimizers may share a directory): named for the process, a process-wide
        count and the rank."""
        config = dict(self._config)
        if config["nvme"] is not None:
            rank = 0
            if self._process_group is not None:
                import torch.distributed as dist
                rank = dist.get_rank(self._process_group)
            name = f"zenflow_state.{os.getpid()}.{next(_state_files)}.rank{rank}.bin"
            config["nvme"] = dict(config["nvme"], file_name=name)
        return config

    def _check_same_parameters(self, ranks):
        """Every rank of the group registers the same parameters: the count, each one's shape and
        dtype, and their names, compared through one all-gather of fixed size before the first
        collective whose size depends on them (the broadcast of rank 0's values). Raises
        ValueError on every rank, naming the first rank that differs and what."""
        import torch.distributed as dist

        def digest(items):
            h = hashlib.blake2b(digest_size=8)
            for item in items:
                h.update(repr(item).encode())
                h.update(b"\0")
            return int.from_bytes(h.digest(), "little", signed=True)

        mine = torch.tensor([len(self._params),
                             digest((tuple(p.shape), str(p.dtype), o) for p, o in zip(self._params, self._orders)),
                             digest(self._names)], dtype=torch.int64)
        everyone = [torch.empty_like(mine) for _ in ranks]
        dist.all_gather(everyone, mine, group=self._own_group)
        what = ("the number of parameters", "their shapes, dtypes or memory layouts", "their names")
        for r, theirs in enumerate(everyone[1:], start=1):
            for k in range(3):
                if theirs[k] != everyone[0][k]:
                    detail = f" ({int(everyone[0][0])} and {int(theirs[0])})" if k == 0 else ""
                    raise ValueError(f"process_group: the ranks registered different parameters: rank {ranks[0]} and "
                                     f"rank {ranks[r]} differ in {what[k]}{detail}; every rank must build the same "
                                     f"model and optimizer")

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
            # Gloo's own deadline is twice the optimizer's: the communicator's (which names the
            # collective and the cause) fires first, and the check below cannot outwait either.
            self._own_group = dist.new_group(ranks=ranks, backend="gloo", use_local_synchronization=True,
                                             timeout=datetime.timedelta(seconds=2 * self._timeout))
            self._check_same_parameters(ranks)  # before anything whose size depends on them
            for p, o in zip(self._params, self._orders):
                view = p.data if o is None else p.data.permute(o)  # contiguous, as the collective needs
                values = view if p.device.type == "cpu" else view.cpu()
                dist.broadcast(values, src=ranks[0], group=self._own_group)
                if values is not view:
                    view.copy_(values)
        if device.type == "cuda":
            first = dist.get_process_group_ranks(self._own_group)[0]
            if dist.get_rank() == first:
                nccl_id = torch.frombuffer(bytearray(_C.nccl_unique_id()), dtype=torch.uint8)
            else:
                nccl_id = torch.zeros(128, dtype=torch.uint8)
            dist.broadcast(nccl_id, src=first, group=self._own_group)
            with torch.cuda.device(device):
                return _C.Coordinator(options, self._core_config(), "cuda", self._own_group, None, self._timeout,
                                      nccl_id.numpy().tobytes())
        store = dist.distributed_c10d._get_process_group_store(self._own_group)
        return _C.Coordinator(options, self._core_config(), "cpu", self._own_group, store, self._timeout)

    def _hand_over(self, i, param):
        """The post-accumulate-grad hook of parameter i (submit_in_backward): hands the gradient
        over during the last of gradient_accumulation_steps backward passes. Whatever it cannot
        hand over is left to step() (which checks it and names any problem)."""
        if self._closed or self._rehand:
            return
        self._backward_count[i] += 1
        grad = param.grad
        if self._backward_count[i] < self.gradient_accumulation_steps or grad is None:
            return
        if i in self._handed:  # a further backward pass adds to a gradient already handed over
            self._rehand = True
            return
        if not self._grad_ok(i, grad):
            return
        try:
            core = self._built()
            core.submit(i, self._core_layout(i, grad), self._stream())
        except ValueError:
            self._rehand = True  # step() hands everything over and reports what is wrong
            return
        self._handed[i] = (grad, grad._version)


def _hook(ref, i):
    def hook(param):
        opt = ref()
        if opt is not None:
            opt._hand_over(i, param)
    return hook


def _float32(where, name, value, low, low_open, high=None, high_open=False, as_number=None):
    """`value` (a real number, or a one-element tensor) checked as a float32 in the range."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex():
            raise ValueError(f"{where}{name}: must be a real number or a one-element tensor, got {value!r}")
        x = float(value.item())
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):  # int, float, numpy scalars
        x = float(value)
    else:
        raise ValueError(f"{where}{name}: must be a number (a float or a one-element tensor), got "
                         f"{value!r} ({type(value).__name__})")
    try:
        f32 = struct.unpack("f", struct.pack("f", x))[0] if abs(x) <= _FLOAT32_MAX else math.inf
    except OverflowError:
        f32 = math.inf
    ok = math.isfinite(f32) and (f32 > low if low_open else f32 >= low)
    ok = ok and (high is None or (f32 < high if high_open else f32 <= high))
    if not ok:
        hi = "inf)" if high is None else f"{high}{')' if high_open else ']'}"
        raise ValueError(f"{where}{name}: must be in {'(' if low_open else '['}{low}, {hi} as a float32, got {value!r}")
    return x


def _memory_order(p):
    """The order of `p`'s dimensions in memory, outermost first, when `p` is laid out without gaps
    or overlap with dimension 0 outermost, or is a transposed matrix: (0, 2, 3, 1) for a
    channels_last convolution weight, (1, 0) for a transposed matrix; None for a contiguous tensor
    (no permutation); False for any other layout (a slice, an expanded view)."""
    if p.is_contiguous():
        return None
    n = p.dim()
    if n == 2:
        return (1, 0) if p.t().is_contiguous() else False
    if n < 2:
        return False
    order = (0, *sorted(range(1, n), key=lambda d: (-p.stride(d), d)))
    return order if p.permute(order).is_contiguous() else False


def _same(a, b):
    """Equal, a list counting as the tuple of its items (betas from JSON against a tuple)."""
    return (tuple(a) if isinstance(a, list) else a) == (tuple(b) if isinstance(b, list) else b)


def _check_unsupported(g, where):
    """torch.optim.AdamW's per-group switches that change what a step computes (or, capturable
    and differentiable, what it may be used for) and that zenflow's Adam does not implement: set in
    a group (at construction, by add_param_group, in a loaded state dict or later by hand), they
    would be silently ignored; rejected instead."""
    for key in ("amsgrad", "maximize", "capturable", "differentiable"):
        if g.get(key, False):
            raise ValueError(f"{where}{key}: not supported by zenflow's Adam, got {g[key]!r} (it must be False or "
                             f"absent)")


def _check_hyper(g, where):
    """A parameter group's (or the defaults') Adam options: each named with its value and range."""
    _check_unsupported(g, where)
    _float32(where, "lr", g["lr"], 0.0, False)
    betas = g["betas"]
    if isinstance(betas, (str, bytes)) or not hasattr(betas, "__len__") or len(betas) != 2:
        raise ValueError(f"{where}betas: must be two numbers in [0, 1), got {betas!r}")
    for k, b in enumerate(betas):
        _float32(where, f"betas[{k}]", b, 0.0, False, 1.0, True)
    _float32(where, "eps", g["eps"], 0.0, True)
    _float32(where, "weight_decay", g["weight_decay"], 0.0, False)
    cd = g.get("column_dim", 1)
    if isinstance(cd, bool) or cd not in (0, 1):
        raise ValueError(f"{where}column_dim: must be 0 or 1, got {cd!r}")


def _adam(g):
    def number(x):
        return float(x.item() if isinstance(x, torch.Tensor) else x)
    return {"lr": number(g["lr"]), "beta1": number(g["betas"][0]), "beta2": number(g["betas"][1]),
            "eps": number(g["eps"]), "weight_decay": number(g["weight_decay"]), "adamw_mode": True}


# The defaults of the method, for documentation tools.
ZenFlowAdamW.METHOD_DEFAULTS = dict(METHOD_DEFAULTS)
