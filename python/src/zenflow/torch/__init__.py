"""zenflow.torch: the zenflow coordinator (ZenFlow, ZeRO-Offload, dense) as a torch optimizer.

    from zenflow.torch import ZenFlowAdamW
    opt = ZenFlowAdamW(model.parameters(), lr=2e-5, topk_ratio=0.1, update_interval=4)

CPU tensors run on the library's host backend; CUDA tensors on its CUDA backend, on
``torch.cuda.current_stream()``, when the extension was built with it (``cuda_available()``).
"""

import torch as _torch  # libtorch must be loaded before the extension

from . import _C
from ._config import deepspeed_options, nvme_config
from .optim import ZenFlowAdamW, param_groups

ZenFlowError = _C.ZenFlowError

__all__ = [
    "ZenFlowAdamW",
    "ZenFlowError",
    "cuda_available",
    "cuda_status",
    "nccl_available",
    "deepspeed_options",
    "nvme_config",
    "param_groups",
]


def cuda_available():
    """True when this build has the CUDA backend (CUDA tensors can be optimized)."""
    return bool(_C.with_cuda)


def nccl_available():
    """True when this build can run data parallel on CUDA tensors (the CUDA backend with NCCL)."""
    return bool(_C.with_nccl)


def cuda_status():
    """One line: whether the CUDA backend was built, and if not, why."""
    if _C.with_cuda:
        nccl = "with NCCL" if _C.with_nccl else f"without NCCL ({_C.nccl_reason})"
        return f"zenflow.torch {_C.version}: CUDA backend built (torch CUDA {_torch.version.cuda}), {nccl}"
    return (f"zenflow.torch {_C.version}: CPU tensors only, the CUDA backend was not built: "
            f"{_C.cuda_reason}")
