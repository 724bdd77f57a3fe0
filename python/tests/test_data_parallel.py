"""ZenFlowAdamW with a process group, under torchrun (2 ranks, Gloo, CPU tensors; on GPUs, NCCL).

Every rank trains on its own half of each batch (data_parallel_worker.py). In zero_offload mode the
result must equal one process stepping on the mean of the two halves' gradients, bit for bit, on
every rank and at every step. In zenflow mode the ranks select by the sum of their column scores
(the method's all-reduce), which is not the score of the mean gradient: the ranks must agree with
each other bit for bit and stay near one process.
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import zenflow.torch

from conftest import make_model
from zenflow.torch import ZenFlowAdamW

sys.path.insert(0, str(Path(__file__).parent))
import data_parallel_worker as worker  # noqa: E402

ZERO_OFFLOAD = dict(worker.METHOD, mode="zero_offload")

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with Gloo is not available")


def torchrun(scenario, out, ranks=2, device="cpu", saved=None):
    """Runs the scenario; the results of the ranks in `saved` (all by default), which must exit 0
    unless some rank is not in `saved` (a rank that ends on its own error)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
               str(Path(worker.__file__)), scenario, str(out), device]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    saved = range(ranks) if saved is None else saved
    assert done.returncode == 0 or len(saved) < ranks, done.stdout[-4000:] + done.stderr[-4000:]
    return [torch.load(out / f"rank{r}.pt", map_location="cpu") for r in saved]


def reference(ranks, method=worker.METHOD, device="cpu"):
    """One process on the mean of the ranks' micro-batch gradients, parameters after each step."""
    torch.set_num_threads(1)  # as each rank (OMP_NUM_THREADS=1): the same gradients, bit for bit
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    worker.deterministic(device)
    try:
        return _reference(ranks, method, device)
    finally:
        torch.use_deterministic_algorithms(was_deterministic)


def _reference(ranks, method, device):
    model = make_model(seed=0).to(device)
    opt = ZenFlowAdamW(worker.groups(model), submit_in_backward=False, **worker.HYPER, **method)
    params, d2h, gpu_columns = [], [], []
    for step in range(worker.STEPS):
        grads = None
        for r in range(ranks):
            opt.zero_grad()
            worker.backward(model, step, r, ranks)
            g = [p.grad.clone() for p in model.parameters()]
            grads = g if grads is None else [a + b for a, b in zip(grads, g)]
        for p, g in zip(model.parameters(), grads):
            p.grad = g * (1.0 / ranks)
        opt.step()
        params.append(worker.cpu(model.parameters()))
        gpu_columns.append([opt.gpu_columns(p) for p in model.parameters()])
        d2h.append(opt.metrics()["bytes_device_to_host"])
    opt.flush()
    final = worker.cpu(model.parameters())
    opt.close()
    reference.gpu_columns = gpu_columns
    return params, d2h, final, model


def check_equal_to_one_process(results, ref_params, ref_final):
    for res in results:
        assert res["errors"] == []
        for step, (got, want) in enumerate(zip(res["params"], ref_params)):
            for a, b in zip(got, want):
                assert torch.equal(a, b), f"rank {res['rank']}, step {step}: max |diff| {(a - b).abs().max()}"
        for a, b in zip(res["final"], ref_final):
            assert torch.equal(a, b)


def test_two_ranks_equal_one_process_on_the_mean_gradient(tmp_path):
    results = torchrun("zero_offload", tmp_path)
    ref_params, ref_d2h, ref_final, model = reference(2, ZERO_OFFLOAD)
    check_equal_to_one_process(results, ref_params, ref_final)
    check_owned_halves(results, model, ref_d2h)


def check_owned_halves(results, model, ref_d2h):
    # Each rank holds the CPU state of its own half of every 2-D parameter's columns (zero_offload:
    # its rows, see ZenFlowAdamW._registered_column_dim)...
    for name, p in model.named_parameters():
        owned = [res["owned"][name] for res in results]
        if p.dim() < 2:
            assert owned == [(0, 0), (0, 0)]
            continue
        cols = p.shape[0]
        assert owned[0][0] == 0 and owned[0][1] == owned[1][0] and owned[1][1] == cols, (name, owned)
        assert abs((owned[0][1] - owned[0][0]) - cols / 2) <= 1, (name, owned)
    # ...and offloads half of one process's bytes per step.
    for res in results:
        assert sum(res["d2h"]) * 2 == pytest.approx(sum(ref_d2h), rel=0.02)


def test_zenflow_ranks_select_and_step_alike_and_stay_near_one_process(tmp_path):
    results = torchrun("zenflow", tmp_path)
    ref_params, _, _, _ = reference(2)
    for step in range(worker.STEPS):
        assert results[0]["gpu_columns"][step] == results[1]["gpu_columns"][step], f"step {step}"
        for a, b in zip(results[0]["params"][step], results[1]["params"][step]):
            assert torch.equal(a, b), f"step {step}"
    for a, b in zip(results[0]["final"], results[1]["final"]):
        assert torch.equal(a, b)
    # The selections differ from one process's (sum of scores vs score of the mean): a few Adam
    # steps of lr = 3e-3 apart after 24 steps (measured 1.9e-2), never diverging.
    drift = max((a - b).abs().max().item() for a, b in zip(results[0]["params"][-1], ref_params[-1]))
    assert drift < 0.05


def test_a_gradient_missing_on_one_rank_fails_the_step_on_every_rank_and_changes_nothing(tmp_path):
    results = torchrun("disagree", tmp_path)
    _, _, ref_final, _ = reference(2, ZERO_OFFLOAD)
    for res in results:
        assert len(res["errors"]) == 1, res["errors"]
        step, message = res["errors"][0]
        assert step == 5 and "param_groups[1].params[5]" in message and "has a gradient on 1 of 2" in message, message
        # The step was taken again with every gradient: the run equals the undisturbed one.
        for a, b in zip(res["final"], ref_final):
            assert torch.equal(a, b)


def test_a_rank_that_stops_makes_every_rank_fail_with_a_clear_error_not_hang(tmp_path):
    results = torchrun("stall", tmp_path)
    first, late = results[0]["errors"], results[1]["errors"]
    assert len(first) == 1 and "did not complete within 3000 ms" in first[0][1], first
    assert len(late) == 1 and "aborted the communicator" in late[0][1], late


def test_a_rank_that_aborts_makes_every_rank_fail_at_once_with_its_reason(tmp_path):
    results = torchrun("abort", tmp_path)
    errors = results[0]["errors"]
    assert len(errors) == 1 and "rank 1 of 2 aborted the communicator: rank 1 exits after an error" in errors[0][1], errors
    assert results[0]["seconds"] < 30.0  # the communicator's timeout is 60 s


@pytest.mark.parametrize("scenario", ["other_model", "other_layout"])
def test_ranks_with_different_models_fail_at_construction_naming_the_difference(tmp_path, scenario):
    # Before the broadcast of rank 0's values, whose sizes (or layout: its state would land on other
    # elements on one rank) would not match (Gloo aborts the process).
    for r in torchrun(scenario, tmp_path):
        assert len(r["errors"]) == 1, r
        assert "rank 0 and rank 1 differ in their shapes, dtypes or memory layouts" in r["errors"][0][1], r["errors"]
        assert r["seconds"] < 30.0  # the group's timeout is 60 s


def test_a_transposed_weight_trains_as_its_contiguous_twin_across_ranks(tmp_path):
    # fc1.weight transposed in memory on every rank (with different initial values: rank 0's reach
    # the others through the transposed view): the same bits as one contiguous process.
    results = torchrun("transposed", tmp_path)
    ref_params, ref_d2h, ref_final, model = reference(2, ZERO_OFFLOAD)
    check_equal_to_one_process(results, ref_params, ref_final)
    check_owned_halves(results, model, ref_d2h)


@pytest.mark.parametrize("how,reason", [
    ("raise_with", "left a `with ZenFlowAdamW(...)` block on RuntimeError: user code failed on rank 1"),
    ("raise_exit", "the program on this rank ended with RuntimeError: user code failed on rank 1"),
])
def test_a_rank_that_fails_in_its_own_code_fails_the_others_at_once_with_its_reason(tmp_path, how, reason):
    # zenflow mode, whose close() would flush: a collective the other rank, still training, does
    # not join. Rank 1 aborts instead, and rank 0's next collective fails with the reason.
    (rank0,) = torchrun(how, tmp_path, saved=[0])
    errors = rank0["errors"]
    assert len(errors) == 1 and f"rank 1 of 2 aborted the communicator: {reason}" in errors[0][1], errors
    assert rank0["seconds"] < 30.0  # the communicator's timeout is 60 s


def test_bad_process_group_arguments_are_rejected():
    model = make_model()
    with pytest.raises(ValueError, match="process_group: torch.distributed is not initialized"):
        ZenFlowAdamW(model.parameters(), process_group=object())
    with pytest.raises(ValueError, match="timeout"):
        ZenFlowAdamW(model.parameters(), process_group=object(), timeout=0)


@pytest.mark.skipif(not torch.cuda.is_available() or not zenflow.torch.nccl_available(),
                    reason="needs a GPU and zenflow.torch built with NCCL")
def test_cuda_ranks_on_nccl_equal_one_process_on_the_mean_gradient(tmp_path):
    """One rank per GPU (NCCL), two when there are two GPUs, else one: equal to one process on
    one GPU stepping on the mean gradient, bit for bit."""
    ranks = min(2, torch.cuda.device_count())
    results = torchrun("zero_offload", tmp_path, ranks=ranks, device="cuda")
    ref_params, ref_d2h, ref_final, model = reference(ranks, ZERO_OFFLOAD, device="cuda")
    check_equal_to_one_process(results, ref_params, ref_final)
    if ranks == 2:
        check_owned_halves(results, model, ref_d2h)
