"""One rank of the data-parallel tests (test_data_parallel.py runs it under torchrun).

    torchrun --nproc-per-node N data_parallel_worker.py SCENARIO OUT_DIR [cpu|cuda]

Each rank trains on its own micro-batch of the batch a single process would take in one step, and
writes what the test compares to OUT_DIR/rank<r>.pt (on the CPU). With ``cuda`` rank r runs on GPU r
(NCCL between the GPUs) with torch's deterministic algorithms.
"""

import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

from conftest import Tiny, batch, make_model
from zenflow.torch import ZenFlowAdamW
from zenflow.torch._C import ZenFlowError

HYPER = dict(lr=3e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
# Selection every 4 steps, CPU updates every 2 steps overlapped with the next interval.
METHOD = dict(mode="zenflow", topk_ratio=0.25, select_strategy="step", select_interval=4, update_interval=2,
              full_warm_up_rounds=0, overlap_step=True)
STEPS = 24
BATCH = 24


def groups(model):
    return [{"params": [model.emb.weight], "column_dim": 0},
            {"params": [p for n, p in model.named_parameters() if not n.startswith("emb.")]}]


def micro_batch(step, rank, ranks):
    tokens, labels = batch(step, n=BATCH)
    per = BATCH // ranks
    return tokens[rank * per:(rank + 1) * per], labels[rank * per:(rank + 1) * per]


def backward(model, step, rank, ranks):
    device = next(model.parameters()).device
    tokens, labels = micro_batch(step, rank, ranks)
    nn.functional.cross_entropy(model(tokens.to(device)), labels.to(device)).backward()


def deterministic(device):
    """On CUDA, the same gradients from the same micro-batch on every GPU and in every process."""
    if device.startswith("cuda"):
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)


def cpu(tensors):
    return [t.detach().cpu().clone() for t in tensors]


def main():
    scenario, out = sys.argv[1], sys.argv[2]
    device = sys.argv[3] if len(sys.argv) > 3 else "cpu"
    dist.init_process_group("gloo")
    rank, ranks = dist.get_rank(), dist.get_world_size()
    if device == "cuda":
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', rank))}"
        torch.cuda.set_device(device)
    deterministic(device)
    # Different initial values on every rank: the optimizer copies the first rank's.
    model = make_model(seed=rank).to(device)
    result = {"rank": rank, "ranks": ranks}
    timeout = 3.0 if scenario == "stall" else 60.0  # "abort": far longer than the failure may take
    method = METHOD if scenario in ("zenflow", "raise_with", "raise_exit") else dict(METHOD, mode="zero_offload")
    if scenario == "transposed" or (scenario == "other_layout" and rank == ranks - 1):
        # fc1.weight laid out as a transposed matrix (the same values): the optimizer registers the
        # contiguous view of its transpose, and copies rank 0's values through it.
        model.fc1.weight.data = model.fc1.weight.data.t().contiguous().t()
    if scenario in ("other_model", "other_layout"):
        # The last rank's model has another hidden width, or one weight in another memory layout:
        # every rank's constructor must say so, before any collective whose size depends on it.
        if scenario == "other_model" and rank == ranks - 1:
            torch.manual_seed(0)
            model = Tiny(hidden=48).to(device)
        start = time.monotonic()
        try:
            ZenFlowAdamW(groups(model), process_group=dist.group.WORLD, timeout=timeout, **HYPER, **method)
            result["errors"] = []
        except ValueError as e:
            result["errors"] = [(0, str(e))]
        result["seconds"] = time.monotonic() - start
        torch.save(result, os.path.join(out, f"rank{rank}.pt"))
        os._exit(0)
    opt = ZenFlowAdamW(groups(model), process_group=dist.group.WORLD, timeout=timeout, **HYPER, **method)
    result["owned"] = {n: opt.owned_columns(p) for n, p in model.named_parameters()}
    result["errors"] = []
    for step in range(STEPS):
        opt.zero_grad()
        # On one rank only, a parameter gets no gradient (frozen this step): every rank must refuse.
        frozen = scenario == "disagree" and step == 5 and rank == 1
        model.fc2.bias.requires_grad_(not frozen)
        backward(model, step, rank, ranks)
        model.fc2.bias.requires_grad_(True)
        if scenario == "stall" and step == 3:
            if rank == 1:
                time.sleep(2 * timeout)  # the others' collectives time out meanwhile
            try:
                opt.step()
            except ZenFlowError as e:
                result["errors"].append((step, str(e)))
            break
        if scenario in ("raise_with", "raise_exit") and step == 3 and rank == 1:
            # The trainer's own code fails on one rank: leaving a `with` block on it, or ending the
            # program with it, aborts the group (flush() would wait for peers still training).
            if scenario == "raise_exit":
                raise RuntimeError("user code failed on rank 1")
            try:
                with opt:
                    raise RuntimeError("user code failed on rank 1")
            except RuntimeError:
                pass
            os._exit(0)
        if scenario in ("raise_with", "raise_exit") and step == 3:
            start = time.monotonic()
            try:
                for later in range(step, STEPS):
                    opt.zero_grad()
                    backward(model, later, rank, ranks)
                    opt.step()
                opt.flush()
            except ZenFlowError as e:
                result["errors"].append((step, str(e)))
            result["seconds"] = time.monotonic() - start
            torch.save(result, os.path.join(out, f"rank{rank}.pt"))
            os._exit(0)
        if scenario == "abort" and step == 3:
            # What a rank that exits after an error does instead of finishing: the extension's
            # abort publishes the reason on the group's Store; the others fail at once with it.
            start = time.monotonic()
            if rank == 1:
                opt._core.abort("rank 1 exits after an error")
            else:
                try:
                    opt.step()
                    opt.flush()
                except ZenFlowError as e:
                    result["errors"].append((step, str(e)))
            result["seconds"] = time.monotonic() - start
            break
        try:
            opt.step()
        except ZenFlowError as e:
            result["errors"].append((step, str(e)))
            # The step changed nothing: hand the gradients over again and step once more.
            opt.zero_grad()
            backward(model, step, rank, ranks)
            opt.step()
        result.setdefault("d2h", []).append(opt.metrics()["bytes_device_to_host"])
        result.setdefault("params", []).append(cpu(model.parameters()))
        result.setdefault("gpu_columns", []).append([opt.gpu_columns(p) for p in model.parameters()])
    if scenario not in ("stall", "abort"):
        opt.flush()
        result["final"] = cpu(model.parameters())
        opt.close()
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    d2h = result.get("d2h", [0])
    print(f"rank {rank} of {ranks} ({scenario}): {len(d2h)} steps, errors {len(result['errors'])}, "
          f"columns {result['owned']}, offloaded {sum(d2h) / len(d2h):.0f} bytes per step", flush=True)
    if scenario in ("stall", "abort"):
        os._exit(0)  # the failed communicator's threads are not waited for
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
