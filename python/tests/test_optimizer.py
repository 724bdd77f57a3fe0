"""ZenFlowAdamW against torch.optim.AdamW and against itself, on CPU tensors (the host backend)."""

import copy
import gc
import io
import math
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from torch import nn

from zenflow.torch import ZenFlowAdamW, deepspeed_options, param_groups
from conftest import batch, make_model, max_diff, train_step

HYPER = dict(lr=3e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
# Per-step bound on |p_zenflow - p_torch| over 300 steps. zenflow's Adam forms the whole change
# of p (decay included) and rounds once; torch multiplies by (1 - lr*wd) first: the two differ by
# a few ulp per step, which Adam's normalisation keeps from growing beyond this. Measured: below
# 2e-5 on an AVX-512 Xeon, 2.003e-5 (dense and ZeRO-Offload, step 296 of 300) on an AVX2 EPYC,
# where torch's CPU kernels take their AVX2 paths; one step's update is lr = 3e-3, 100x the bound.
TRACK_TOL = 3e-5


def groups(model):
    """One set of hyper-parameters; the embedding's columns are its embeddings (column_dim 0)."""
    return [
        {"params": [model.emb.weight], "column_dim": 0},
        {"params": [p for n, p in model.named_parameters() if not n.startswith("emb.")]},
    ]


@pytest.mark.parametrize("mode", ["dense", "zero_offload"])
def test_tracks_torch_adamw(mode):
    ref, ours = make_model(), make_model()
    ref_opt = torch.optim.AdamW(ref.parameters(), **HYPER)
    with ZenFlowAdamW(groups(ours), mode=mode, **HYPER) as opt:
        for step in range(300):
            train_step(ref, ref_opt, step)
            train_step(ours, opt, step)
            d = max_diff(ref, ours)
            assert d <= TRACK_TOL, f"step {step}: max |diff| {d}"


def test_zero_offload_equals_dense_exactly():
    a, b = make_model(), make_model()
    with ZenFlowAdamW(groups(a), mode="dense", **HYPER) as oa, \
            ZenFlowAdamW(groups(b), mode="zero_offload", **HYPER) as ob:
        for step in range(200):
            train_step(a, oa, step)
            train_step(b, ob, step)
            assert max_diff(a, b) == 0.0, f"step {step}"
        assert ob.metrics()["cpu_update_launched"] and ob.metrics()["bytes_device_to_host"] > 0
        assert oa.metrics()["bytes_device_to_host"] == 0


def test_zero_offload_registers_rows_as_columns():
    # ZeRO-Offload selects no column, so every 2-D parameter is registered with column_dim 0 (its
    # columns contiguous rows, copied to the CPU and back rather than transposed), whatever its
    # group says: groups that differ only in column_dim give byte-identical optimizer state.
    def run(column_dim):
        m = make_model()
        gs = [{"params": [p for n, p in m.named_parameters()], "column_dim": column_dim}]
        with ZenFlowAdamW(gs, mode="zero_offload", max_grad_norm=0.05, **HYPER) as opt:
            for step in range(5):
                train_step(m, opt, step)
            sd = opt.state_dict()
        return m, sd

    a, sa = run(1)
    b, sb = run(0)
    assert max_diff(a, b) == 0.0
    assert sa["zenflow"]["columns"] == "column_dim_0"
    assert bytes(sa["zenflow"]["checkpoint"].numpy()) == bytes(sb["zenflow"]["checkpoint"].numpy())
    # A state dict from before (no "columns"): its state is laid out by input channels.
    old = copy.deepcopy(sa)
    old["zenflow"].pop("columns")
    c = make_model()
    with ZenFlowAdamW([{"params": list(c.parameters()), "column_dim": 1}], mode="zero_offload",
                      max_grad_norm=0.05, **HYPER) as opt:
        train_step(c, opt, 0)
        with pytest.raises(ValueError, match="zero_offload mode saw a weight's columns as its input channels"):
            opt.load_state_dict(old)
        opt.load_state_dict(sa)


def test_clipping_tracks_torch_clip_grad_norm():
    ref, ours = make_model(), make_model()
    ref_opt = torch.optim.AdamW(ref.parameters(), **HYPER)
    with ZenFlowAdamW(groups(ours), mode="dense", max_grad_norm=0.05, **HYPER) as opt:
        for step in range(100):
            tokens, labels = batch(step)
            ref_opt.zero_grad()
            nn.functional.cross_entropy(ref(tokens), labels).backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
            ref_opt.step()
            train_step(ours, opt, step)
            assert max_diff(ref, ours) <= TRACK_TOL, f"step {step}"


def test_gradient_accumulation_tracks_torch():
    ref, ours = make_model(), make_model()
    ref_opt = torch.optim.AdamW(ref.parameters(), **HYPER)
    with ZenFlowAdamW(groups(ours), mode="zero_offload", gradient_accumulation_steps=2, **HYPER) as opt:
        for step in range(50):
            for m, o in ((ref, ref_opt), (ours, opt)):
                o.zero_grad()
                for micro in range(2):
                    tokens, labels = batch(2 * step + micro)
                    (nn.functional.cross_entropy(m(tokens), labels) / 2).backward()
                o.step()
            assert max_diff(ref, ours) <= TRACK_TOL, f"step {step}"


@pytest.mark.parametrize("overlap", [False, True])
def test_zenflow_staleness_and_write_back(overlap):
    interval = 4
    model = make_model()
    with ZenFlowAdamW(groups(model), topk_ratio=0.25, update_interval=interval, select_interval=20,
                      overlap_step=overlap, record_trace=True, **HYPER) as opt:
        expected_d2h = 0
        for step in range(60):
            train_step(model, opt, step)
            if step == 0:
                for name, p, rows, cols in (("emb", model.emb.weight, 16, 40), ("fc1", model.fc1.weight, 32, 16),
                                            ("fc2", model.fc2.weight, 4, 32)):
                    k = max(1, int(0.25 * cols))
                    assert len(opt.gpu_columns(p)) == k, name
                    expected_d2h += (cols - k) * rows * 4
            m = opt.metrics()
            if not m["reselected"]:
                assert m["bytes_device_to_host"] == expected_d2h, f"step {step}"
        opt.flush()
        trace = opt.trace()
    assert len(trace) >= 60 // interval
    for r in trace:
        assert r["write_backs"] == 1, r
        assert r["synchronous"] != overlap or r["last_step"] == 59 or r["written_back_at"] == r["last_step"], r
        bound = r["last_step"] + (interval if overlap else 0)
        assert r["last_step"] <= r["written_back_at"] <= bound, r


def test_columns_linear_and_embedding():
    # One important column per weight: the selection must find it under the documented convention.
    model = make_model()
    with ZenFlowAdamW(groups(model), topk_ratio=1 / 16, update_interval=8, select_interval=8, **HYPER) as opt:
        before = copy.deepcopy(model)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        model.fc1.weight.grad[:, 5] = 1.0  # input feature 5 of fc1 (W[out, in]: column = second index)
        model.emb.weight.grad[7, :] = 1.0  # embedding 7 (column = first index)
        opt.step()
        assert opt.gpu_columns(model.fc1.weight) == [5]
        assert 7 in opt.gpu_columns(model.emb.weight)  # k = 2 of 40; the other has score 0
        # The GPU column changed at once; the CPU columns wait for their interval.
        changed = (model.fc1.weight - before.fc1.weight).abs().sum(0) > 0
        assert changed.nonzero().flatten().tolist() == [5]
        changed = (model.emb.weight - before.emb.weight).abs().sum(1) > 0
        assert 7 in changed.nonzero().flatten().tolist()


def _run(mode, overlap):
    model = make_model()
    opt = ZenFlowAdamW(groups(model), mode=mode, topk_ratio=0.25, update_interval=3, select_interval=9,
                       overlap_step=overlap, **HYPER)
    return model, opt


@pytest.mark.parametrize("mode,overlap", [("zenflow", True), ("zenflow", False), ("zero_offload", False)])
def test_state_dict_round_trip_bit_identical(mode, overlap):
    model, opt = _run(mode, overlap)
    for step in range(25):
        train_step(model, opt, step)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buf)  # as Trainer saves
    for step in range(25, 45):
        train_step(model, opt, step)
    opt.flush()
    resumed, ropt = _run(mode, overlap)  # different weights until the checkpoint restores them
    with torch.no_grad():
        for p in resumed.parameters():
            p.add_(1.0)
    buf.seek(0)
    saved = torch.load(buf, weights_only=False)
    resumed.load_state_dict(saved["model"])  # the model's weights first, then the optimizer's state
    ropt.load_state_dict(saved["optimizer"])
    for step in range(25, 45):
        train_step(resumed, ropt, step)
    ropt.flush()
    assert max_diff(model, resumed) == 0.0
    opt.close()
    ropt.close()


def test_strided_gradients_step_as_their_contiguous_copies():
    # torch.optim takes any strided .grad (a transposed one set by hand, every other element of
    # a buffer, autograd's stride-0 gradient of a term that only sums a parameter).
    a, b = make_model(), make_model()
    with ZenFlowAdamW(a.parameters(), **HYPER) as oa, ZenFlowAdamW(b.parameters(), **HYPER) as ob:
        for step in range(6):
            for model, opt, strided in ((a, oa, False), (b, ob, True)):
                tokens, labels = batch(step)
                opt.zero_grad()
                loss = nn.functional.cross_entropy(model(tokens), labels)
                loss.backward()
                if strided:
                    g = model.fc1.weight.grad
                    model.fc1.weight.grad = g.t().contiguous().t()
                    assert not model.fc1.weight.grad.is_contiguous()
                    spaced = torch.zeros(2 * model.fc2.bias.numel())
                    spaced[::2] = model.fc2.bias.grad
                    model.fc2.bias.grad = spaced[::2]
                    assert not model.fc2.bias.grad.is_contiguous()
                opt.step()
            assert max_diff(a, b) == 0.0, step


class Convnet(nn.Module):
    """Two convolutions and a linear head: 4-D weights, which channels_last lays out (0, 2, 3, 1)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv1, self.conv2 = nn.Conv2d(3, 8, 3), nn.Conv2d(8, 6, 3)
        self.head = nn.Linear(6 * 4 * 4, 5)

    def forward(self, x):
        return self.head(self.conv2(torch.relu(self.conv1(x))).flatten(1))


LAYOUT_MODES = [dict(mode="dense"), dict(mode="zero_offload"),
                dict(mode="zenflow", topk_ratio=0.25, update_interval=2, select_interval=3, overlap_step=False),
                dict(mode="zenflow", topk_ratio=0.25, update_interval=2, select_interval=3, overlap_step=True)]


def _in_other_layouts(model):
    """The model with its convolution weights channels_last and its head's weight transposed in
    memory: the same values, other strides (what torch.optim steps without noticing)."""
    model.to(memory_format=torch.channels_last)
    model.head.weight.data = model.head.weight.data.t().contiguous().t()
    assert model.conv1.weight.is_contiguous(memory_format=torch.channels_last)
    assert not model.conv2.weight.is_contiguous() and not model.head.weight.is_contiguous()
    return model


@pytest.mark.parametrize("method", LAYOUT_MODES, ids=lambda m: f"{m['mode']}-{m.get('overlap_step', '')}")
def test_parameters_in_any_dense_memory_layout_train_as_their_contiguous_twins(method):
    # channels_last convolution weights (diffusers' and torchvision's advice for speed) and a
    # transposed matrix: registered as the contiguous view of their dimensions in memory order, the
    # same bits as contiguous parameters, whichever layout each step's gradient comes in.
    a, b = Convnet(), _in_other_layouts(Convnet())
    with ZenFlowAdamW(a.parameters(), **HYPER, **method) as oa, ZenFlowAdamW(b.parameters(), **HYPER, **method) as ob:
        gen = torch.Generator().manual_seed(7)
        for step in range(12):
            for p, q in zip(a.parameters(), b.parameters()):
                g = torch.randn(p.shape, generator=gen)
                p.grad = g
                # the parameter's layout (as autograd makes it), or contiguous (handed over as a copy)
                q.grad = torch.empty_like(q).copy_(g) if step % 2 else g.clone()
            oa.step()
            ob.step()
            assert max_diff(a, b) == 0.0, step
            # A transposed matrix's columns are its input channels still.
            assert oa.gpu_columns(a.head.weight) == ob.gpu_columns(b.head.weight), step
        assert oa.owned_columns(a.head.weight) == ob.owned_columns(b.head.weight)
        oa.flush()
        ob.flush()
        assert max_diff(a, b) == 0.0
        assert b.conv1.weight.is_contiguous(memory_format=torch.channels_last)  # written in place


def test_a_channels_last_model_trains_with_autograd_and_gradients_handed_over_in_backward():
    # Autograd makes each gradient in its parameter's layout: the hand-over in backward needs no copy
    # and is kept (a dropped one would warn), and the run tracks torch's AdamW.
    ours, ref = _in_other_layouts(Convnet()), _in_other_layouts(Convnet())
    ref_opt = torch.optim.AdamW(ref.parameters(), **HYPER)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with ZenFlowAdamW(ours.parameters(), mode="dense", submit_in_backward=True, **HYPER) as opt:
            for step in range(20):
                x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(step))
                x = x.to(memory_format=torch.channels_last)
                for model, o in ((ours, opt), (ref, ref_opt)):
                    o.zero_grad()
                    model(x).pow(2).mean().backward()
                    o.step()
                assert max_diff(ours, ref) <= TRACK_TOL, step


def test_a_state_dict_does_not_load_into_parameters_in_another_memory_layout():
    # The state follows each parameter's memory order: loaded into a channels_last model's
    # optimizer, a contiguous model's state would land on other elements. Rejected, naming the
    # parameter, with nothing changed; the same layout resumes bit for bit.
    def run(model, steps, opt=None):
        opt = opt or ZenFlowAdamW(model.parameters(), mode="zenflow", topk_ratio=0.25, update_interval=2, **HYPER)
        for step in steps:
            opt.zero_grad()
            x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(step))
            model(x).pow(2).mean().backward()
            opt.step()
        return opt

    model = _in_other_layouts(Convnet())
    opt = run(model, range(5))
    saved = copy.deepcopy(model.state_dict()), opt.state_dict()
    run(model, range(5, 9), opt)
    opt.flush()
    contiguous = Convnet()
    contiguous.load_state_dict(saved[0])
    other = run(contiguous, range(2))
    contiguous.load_state_dict(saved[0])
    with torch.no_grad():
        before = [p.clone() for p in contiguous.parameters()]
    with pytest.raises(ValueError, match=r"state_dict: param_groups\[0\]\.params\[0\] was laid out in memory in "
                                         r"dimension order \(0, 2, 3, 1\) when the state was saved and is contiguous "
                                         r"now"):
        other.load_state_dict(saved[1])
    assert all(torch.equal(p, q) for p, q in zip(contiguous.parameters(), before))
    other.close()
    resumed = _in_other_layouts(Convnet())
    resumed.load_state_dict(saved[0])
    ropt = ZenFlowAdamW(resumed.parameters(), mode="zenflow", topk_ratio=0.25, update_interval=2, **HYPER)
    ropt.load_state_dict(saved[1])
    run(resumed, range(5, 9), ropt)
    ropt.flush()
    assert max_diff(model, resumed) == 0.0
    opt.close()
    ropt.close()


@pytest.mark.parametrize("mode,dtype", [("zenflow", torch.float32), ("zero_offload", torch.float32),
                                        ("dense", torch.bfloat16)])
def test_a_rejected_load_keeps_an_edit_of_the_weights_for_the_next_step(mode, dtype):
    # The weights are rolled back in place (model.load_state_dict), then an optimizer state dict
    # that does not fit is tried and rejected: the next step starts from the rolled-back weights,
    # as it does without the rejected load (and with torch.optim), not from the optimizer's master.
    def run(rejected_load):
        model = make_model().to(dtype)
        saved = copy.deepcopy(model.state_dict())
        opt = ZenFlowAdamW(model.parameters(), mode=mode, **HYPER)
        for step in range(3):
            train_step(model, opt, step)
        model.load_state_dict(saved)
        if rejected_load:
            other = make_model()
            other.fc1 = nn.Linear(16, 8)  # the same parameters, one of another shape
            other.norm = nn.LayerNorm(8)
            other.fc2 = nn.Linear(8, 4)
            other.to(dtype)
            bad = ZenFlowAdamW(other.parameters(), mode=mode, **HYPER)
            train_step(other, bad, 0)
            with pytest.raises(Exception, match="shape"):
                opt.load_state_dict(bad.state_dict())
            bad.close()
        train_step(model, opt, 3)
        opt.flush()
        weights = [p.detach().clone() for p in model.parameters()]
        opt.close()
        return weights

    assert all(torch.equal(a, b) for a, b in zip(run(False), run(True)))


def test_a_state_dict_loads_by_position_whatever_the_parameter_names():
    # torch.optim pairs parameters by position: a checkpoint of named_parameters() loads into an
    # optimizer of parameters() and into one over a wrapped model (torch.compile's "_orig_mod.").
    def run(named, prefix=""):
        model = make_model()
        params = [(prefix + n, p) for n, p in model.named_parameters()] if named else model.parameters()
        return model, ZenFlowAdamW(params, mode="zenflow", topk_ratio=0.5, update_interval=2, **HYPER)
    model, opt = run(named=True)
    for step in range(5):
        train_step(model, opt, step)
    saved = copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict()})
    for step in range(5, 9):
        train_step(model, opt, step)
    opt.flush()
    for named, prefix in ((False, ""), (True, "_orig_mod.")):
        resumed, ropt = run(named, prefix)
        resumed.load_state_dict(saved["model"])
        ropt.load_state_dict(saved["optimizer"])
        for step in range(5, 9):
            train_step(resumed, ropt, step)
        ropt.flush()
        assert max_diff(model, resumed) == 0.0, (named, prefix)
        ropt.close()
    opt.close()


SCHEDULES = {
    # lr only: a warm-up and a linear decay
    "warm_up_decay": lambda o: torch.optim.lr_scheduler.LambdaLR(
        o, lambda s: min(1.0, (s + 1) / 10) * max(0.0, 1 - s / 120)),
    # lr and beta1: OneCycleLR with its default cycle_momentum (beta1 from 0.95 down to 0.85 and back)
    "one_cycle": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=3e-3, total_steps=120),
}


@pytest.mark.parametrize("schedule", ["warm_up_decay", "one_cycle"])
@pytest.mark.parametrize("mode", ["dense", "zero_offload", "zenflow"])
def test_a_resume_in_the_middle_of_an_lr_schedule_is_bit_identical(mode, schedule):
    # A scheduler steps after opt.step(), so the saved param_groups hold the next step's lr (and
    # beta1) while the checkpoint's coordinator state holds the last step's: the loaded groups must
    # win.
    def run():
        model = make_model()
        opt = ZenFlowAdamW(groups(model), mode=mode, topk_ratio=0.25, update_interval=3, select_interval=9,
                           **HYPER)
        sched = SCHEDULES[schedule](opt)
        return model, opt, sched

    model, opt, sched = run()
    for step in range(20):
        train_step(model, opt, step)
        sched.step()
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "sched": sched.state_dict()}, buf)
    for step in range(20, 30):
        train_step(model, opt, step)
        sched.step()
    opt.flush()
    resumed, ropt, rsched = run()
    buf.seek(0)
    saved = torch.load(buf, weights_only=False)
    resumed.load_state_dict(saved["model"])
    ropt.load_state_dict(saved["optimizer"])
    rsched.load_state_dict(saved["sched"])
    for step in range(20, 30):
        train_step(resumed, ropt, step)
        rsched.step()
    ropt.flush()
    assert max_diff(model, resumed) == 0.0
    opt.close()
    ropt.close()


@pytest.mark.parametrize("mode", ["dense", "zero_offload"])
def test_lr_and_weight_decay_edited_in_a_state_dict_apply_after_loading(mode):
    model = make_model()
    opt = ZenFlowAdamW(groups(model), mode=mode, **HYPER)
    for step in range(3):
        train_step(model, opt, step)
    sd = opt.state_dict()
    for g in sd["param_groups"]:
        g["lr"], g["weight_decay"] = 0.0, 0.0
    opt.load_state_dict(sd)
    before = copy.deepcopy(model)
    train_step(model, opt, 3)
    assert max_diff(before, model) == 0.0  # lr 0: nothing moves
    opt.close()


@pytest.mark.parametrize("mode", ["dense", "zero_offload", "zenflow"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_low_precision_model_edited_before_state_dict_resumes(mode, dtype):
    # After an adopted edit a bf16/fp16 parameter's fp32 master is exactly its values; the
    # checkpoint must still carry it (the load takes a master from f32 values only).
    def run():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).to(dtype)
        return m, ZenFlowAdamW(m.parameters(), lr=1e-2, mode=mode, topk_ratio=0.5, update_interval=2)

    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(1)).to(dtype)

    def step(m, opt):
        opt.zero_grad()
        m(x).float().pow(2).mean().backward()
        opt.step()

    m, opt = run()
    for _ in range(3):
        step(m, opt)
    with torch.no_grad():
        m[2].weight.mul_(0.9)
    saved = {"model": copy.deepcopy(m.state_dict()), "optimizer": opt.state_dict()}
    for _ in range(3):
        step(m, opt)
    opt.flush()
    resumed, ropt = run()
    resumed.load_state_dict(saved["model"])
    ropt.load_state_dict(saved["optimizer"])
    for _ in range(3):
        step(resumed, ropt)
    ropt.flush()
    assert max_diff(m, resumed) == 0.0
    opt.close()
    ropt.close()


def test_an_optimizer_dropped_without_close_writes_its_pending_update():
    # ZenFlow async leaves the last interval's CPU update pending: garbage collection completes it,
    # as close() does.
    def train(close):
        model = make_model()
        opt = ZenFlowAdamW(groups(model), topk_ratio=0.25, update_interval=4, **HYPER)
        for step in range(7):
            train_step(model, opt, step)
        if close:
            opt.close()
        return model  # opt goes out of scope here

    closed = train(True)
    dropped = train(False)
    gc.collect()  # (in CPython the optimizer is freed at the return already)
    assert max_diff(closed, dropped) == 0.0


def _restricted_threads(allowed):
    """{thread id: its CPUs} for the threads of this process whose CPUs are a proper subset of
    `allowed` (Linux)."""
    found = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            cpus = os.sched_getaffinity(int(tid))
        except OSError:  # the thread ended meanwhile
            continue
        if cpus < allowed:
            found[int(tid)] = cpus
    return found


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs CPU affinity and two CPUs")
def test_reserved_cpus_keep_the_optimizer_threads_off_the_trainers_cpus():
    allowed = os.sched_getaffinity(0)
    first = min(allowed)
    already = set(_restricted_threads(allowed))  # whatever restricted itself before (none of ours)
    results = []
    for reserved in (0, len(allowed) - 1):
        model = make_model()
        opt = ZenFlowAdamW(groups(model), topk_ratio=0.25, update_interval=3, select_interval=9, overlap_step=True,
                           reserved_cpus=reserved, **HYPER)
        for step in range(8):
            train_step(model, opt, step)
        restricted = {t: c for t, c in _restricted_threads(allowed).items() if t not in already}
        if reserved:
            # the offload and update workers and their pools' workers, none on the first CPU
            assert len(restricted) >= 2
            assert all(first not in cpus for cpus in restricted.values()), restricted
        else:
            assert restricted == {}
        opt.flush()
        results.append(model)
        opt.close()
    assert max_diff(results[0], results[1]) == 0.0  # where the threads run changes no result
    assert set(_restricted_threads(allowed)) <= already  # close() joined them


def test_pt_reserved_cores_perc_reserves_that_fraction_of_the_cpus():
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    block = {"zero_optimization": {"zenflow": {"topk_ratio": 0.1, "pt_reserved_cores_perc": 0.5}}}
    assert deepspeed_options(block)["reserved_cpus"] == min(math.ceil(0.5 * n), n - 1)
    block["zero_optimization"]["zenflow"]["pt_reserved_cores_perc"] = 1.0
    assert deepspeed_options(block)["reserved_cpus"] == n - 1  # the optimizer keeps one
    block["zero_optimization"]["zenflow"]["pt_reserved_cores_perc"] = 0.0
    assert deepspeed_options(block)["reserved_cpus"] == 0
    del block["zero_optimization"]["zenflow"]["pt_reserved_cores_perc"]
    assert "reserved_cpus" not in deepspeed_options(block)  # none reserved without the key
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # read, no longer ignored with a warning
        opt = ZenFlowAdamW(make_model().parameters(), zenflow_config={"pt_reserved_cores_perc": 0.0})
    opt.close()
    if n >= 3:
        with pytest.raises(ValueError, match="reserved_cpus: 1 contradicts zenflow_config's pt_reserved_cores_perc"):
            ZenFlowAdamW(make_model().parameters(), reserved_cpus=1,
                         zenflow_config={"pt_reserved_cores_perc": 1.0})


def _compact_run(cpu_state):
    model = make_model()
    opt = ZenFlowAdamW(groups(model), topk_ratio=0.25, update_interval=3, select_interval=9, overlap_step=True,
                       cpu_state=cpu_state, **HYPER)
    return model, opt


@pytest.mark.parametrize("cpu_state,tol", [("bf16_moments", 2e-3), ("blockwise8_moments", 1e-2)])
def test_compact_cpu_state_tracks_fp32_and_resumes_bit_identically(cpu_state, tol):
    ref, ref_opt = _compact_run("fp32")
    ours, opt = _compact_run(cpu_state)
    buf = io.BytesIO()
    for step in range(80):
        if step == 60:  # mid-interval, a CPU update pending
            torch.save({"model": ours.state_dict(), "optimizer": opt.state_dict()}, buf)
        train_step(ref, ref_opt, step)
        train_step(ours, opt, step)
    ref_opt.flush()
    opt.flush()
    d = max_diff(ref, ours)
    assert 0.0 < d <= tol, f"max |p_{cpu_state} - p_fp32| = {d}"
    resumed, resumed_opt = _compact_run(cpu_state)
    saved = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
    resumed.load_state_dict(saved["model"])
    resumed_opt.load_state_dict(saved["optimizer"])
    for step in range(60, 80):
        train_step(resumed, resumed_opt, step)
    resumed_opt.flush()
    assert max_diff(ours, resumed) == 0.0
    # The moments are saved as fp32: the checkpoint loads into fp32 state too, and trains on.
    other, other_opt = _compact_run("fp32")
    other.load_state_dict(saved["model"])
    other_opt.load_state_dict(saved["optimizer"])
    train_step(other, other_opt, 60)
    for o in (ref_opt, opt, resumed_opt, other_opt):
        o.close()
    with pytest.raises(ValueError, match="cpu_state"):
        ZenFlowAdamW(make_model().parameters(), cpu_state="int4")


def test_metrics_dict():
    model = make_model()
    with ZenFlowAdamW(groups(model), topk_ratio=0.25, update_interval=2, **HYPER) as opt:
        assert opt.metrics() == {}
        train_step(model, opt, 0)
        m = opt.metrics()
    assert set(m) == {"step", "stall_seconds", "stall_reason", "cpu_update_seconds", "bytes_device_to_host",
                      "bytes_host_to_device", "selection_overlap", "interval", "interval_floor", "reselected",
                      "cpu_update_launched", "written_back", "cpu_update_disk_read_bytes",
                      "cpu_update_disk_written_bytes", "cpu_update_disk_wait_seconds", "skipped", "grad_norm"}
    assert m["step"] == 0 and m["reselected"] and not m["skipped"] and m["grad_norm"] > 0


def test_host_memory_reports_what_each_mode_holds():
    # On CPU tensors with fp32 gradients, ZeRO-Offload updates every weight in place: its CPU
    # state and nothing else. ZenFlow with overlap holds two fp32 accumulators of its CPU columns
    # and the write-back staging.
    model = make_model()
    weights = {"emb.weight": 0, "fc1.weight": 1, "fc2.weight": 1}  # name -> the dim of a column's index
    n_2d = sum(p.numel() for n, p in model.named_parameters() if n in weights)
    with ZenFlowAdamW(groups(model), mode="zero_offload", **HYPER) as opt:
        assert opt.host_memory() is None  # nothing registered before the first step
        train_step(model, opt, 0)
        m = opt.host_memory()
    assert set(m) == {"cpu_state", "accumulators", "copy_out", "state_file_pool", "device_buffers", "host_total"}
    assert m["accumulators"] == 0 and m["device_buffers"] == 0 and m["copy_out"] == 0
    assert m["cpu_state"] == 12 * n_2d  # fp32 master, exp_avg and exp_avg_sq of every weight
    assert m["host_total"] == m["cpu_state"]

    model = make_model()
    with ZenFlowAdamW(groups(model), topk_ratio=0.25, update_interval=2, **HYPER) as opt:
        for step in range(3):
            train_step(model, opt, step)
        m = opt.host_memory()
        cpu_elements = 0
        for name, p in model.named_parameters():
            if name in weights:
                cols = p.shape[0] if weights[name] == 0 else p.shape[1]
                cpu_elements += (cols - len(opt.gpu_columns(p))) * (p.numel() // cols)
    assert 0 < cpu_elements < n_2d
    assert m["accumulators"] == 2 * 4 * cpu_elements  # overlap_step: one per interval parity
    assert m["device_buffers"] > 0 and m["copy_out"] == 0 and m["state_file_pool"] == 0
    assert m["host_total"] == m["cpu_state"] + m["accumulators"]


def test_cover_cpu_update_holds_the_auto_interval_to_the_measured_update():
    # The rule's effect on stalls is tested in C++ (a CPU update made slow on purpose); here: the
    # option reaches the coordinator, the floor is reported, and the interval respects it.
    model = make_model()
    with ZenFlowAdamW(groups(model), topk_ratio=0.25, update_interval="auto", cover_cpu_update=True,
                      **HYPER) as opt:
        floors = []
        for step in range(24):
            train_step(model, opt, step)
            m = opt.metrics()
            assert m["interval"] >= m["interval_floor"] >= 0
            floors.append(m["interval_floor"])
        assert max(floors) >= 1  # measured once an update completed
    plain = make_model()
    with ZenFlowAdamW(groups(plain), topk_ratio=0.25, update_interval="auto", **HYPER) as opt:
        train_step(plain, opt, 0)
        assert opt.metrics()["interval_floor"] == 0  # off by default


def test_close_and_context_manager():
    model = make_model()
    with ZenFlowAdamW(groups(model), topk_ratio=0.25, update_interval=4, **HYPER) as opt:
        for step in range(6):
            train_step(model, opt, step)
    with pytest.raises(ValueError, match="closed"):
        train_step(model, opt, 6)
    opt.close()  # idempotent


def test_interpreter_exit_completes_pending_work(tmp_path):
    # Leaves an asynchronous CPU update pending and the optimizer open: atexit closes it.
    script = textwrap.dedent("""
        import torch, sys
        sys.path.insert(0, %r)
        from conftest import make_model, train_step
        from zenflow.torch import ZenFlowAdamW
        model = make_model()
        opt = ZenFlowAdamW(model.parameters(), topk_ratio=0.25, update_interval=4)
        for step in range(7):
            train_step(model, opt, step)
        print("trained")
    """ % str(__import__("pathlib").Path(__file__).parent))
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "trained" in r.stdout


def test_param_groups_track_torch():
    ref, ours = make_model(), make_model()
    ref_opt = torch.optim.AdamW(param_groups(ref, weight_decay=0.1), lr=3e-3)
    gs = param_groups(ours, weight_decay=0.1)
    gs[0]["lr"] = 1e-3
    ref_gs = param_groups(ref, weight_decay=0.1)
    ref_gs[0]["lr"] = 1e-3
    ref_opt = torch.optim.AdamW(ref_gs, lr=3e-3)
    with ZenFlowAdamW(gs, lr=3e-3, mode="zero_offload") as opt:
        for step in range(100):
            train_step(ref, ref_opt, step)
            train_step(ours, opt, step)
            assert max_diff(ref, ours) <= TRACK_TOL, f"step {step}"


@pytest.mark.parametrize("mode", ["dense", "zero_offload"])
def test_groups_with_their_own_betas_and_eps_track_torch(mode):
    # torch.optim keeps betas and eps per group, as lr and weight decay.
    def own(model):
        gs = param_groups(model, weight_decay=0.1)
        gs[0].update(betas=(0.8, 0.99), eps=1e-6)
        return gs
    ref, ours = make_model(), make_model()
    ref_opt = torch.optim.AdamW(own(ref), lr=3e-3)
    with ZenFlowAdamW(own(ours), lr=3e-3, mode=mode) as opt:
        assert opt.param_groups[0]["betas"] == (0.8, 0.99) and opt.param_groups[1]["betas"] == (0.9, 0.999)
        for step in range(100):
            train_step(ref, ref_opt, step)
            train_step(ours, opt, step)
            assert max_diff(ref, ours) <= TRACK_TOL, f"step {step}"


@pytest.mark.parametrize("schedule", ["warm_up_decay", "one_cycle"])
@pytest.mark.parametrize("mode", ["dense", "zero_offload"])
def test_lr_scheduler_tracks_torch(mode, schedule):
    ref, ours = make_model(), make_model()
    ref_opt = torch.optim.AdamW(ref.parameters(), **HYPER)
    opt = ZenFlowAdamW(groups(ours), mode=mode, **HYPER)
    sched = [SCHEDULES[schedule](o) for o in (ref_opt, opt)]
    betas = set()
    for step in range(100):
        betas.add(opt.param_groups[0]["betas"][0])
        train_step(ref, ref_opt, step)
        train_step(ours, opt, step)
        for s in sched:
            s.step()
        assert max_diff(ref, ours) <= TRACK_TOL, f"step {step}"
    assert (len(betas) == 1) if schedule == "warm_up_decay" else (len(betas) > 50)  # OneCycleLR moves beta1
    opt.close()


@pytest.mark.parametrize("mode", ["dense", "zero_offload", "zenflow"])
def test_a_skipped_step_is_reported_and_warned(mode):
    # One infinity in one gradient: the step changes nothing (no CPU update is due at steps 2 and 3:
    # the interval [2, 3] has no finite step), step() warns, and metrics() says which steps were
    # skipped and the gradients' global norm (torch's clip_grad_norm_ total).
    model = make_model()
    with ZenFlowAdamW(model.parameters(), mode=mode, overlap_step=False, update_interval=2, **HYPER) as opt:
        assert "skipped" not in opt.metrics()
        for step in range(6):
            tokens, labels = batch(step)
            opt.zero_grad()
            nn.functional.cross_entropy(model(tokens), labels).backward()
            if step in (2, 3):
                model.fc1.weight.grad[1, 2] = float("inf")
            norm = torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(p.grad.double()) for p in model.parameters()]))
            before = [p.detach().clone() for p in model.parameters()]
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                opt.step()
            skipped = [w for w in caught if "skipped" in str(w.message)]
            m = opt.metrics()
            assert m["skipped"] == (step in (2, 3)) and len(skipped) == int(step in (2, 3)), step
            if m["skipped"]:
                assert issubclass(skipped[0].category, RuntimeWarning) and f"step {step}" in str(skipped[0].message)
                assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
            else:
                assert m["grad_norm"] == pytest.approx(norm.item(), rel=1e-9)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_skipped_step_applies_none_of_its_gradients_but_a_cpu_update_due_at_it_lands(overlap):
    # A skipped step updates nothing from its own gradients. A CPU update due at it (the interval
    # that ends there; with overlap_step, the pending update its staleness bound writes back) holds
    # earlier steps' gradients only and is written back as due: the run equals one that ran the
    # steps before it and then flush() (which ends the interval early, or writes the pending update
    # back), bit for bit.
    def run(poisoned):
        model = make_model()
        opt = ZenFlowAdamW(model.parameters(), topk_ratio=0.25, update_interval=2, select_interval=8,
                           full_warm_up_rounds=0, overlap_step=overlap, **HYPER)
        last = 3 if overlap else 1  # sync: the end of interval [0, 1]; async: [0, 1] is written back at 3
        for step in range(last + 1 if poisoned else last):
            tokens, labels = batch(step)
            opt.zero_grad()
            nn.functional.cross_entropy(model(tokens), labels).backward()
            if step == last:
                model.fc1.weight.grad[1, 2] = float("nan")
                before = [p.detach().clone() for p in model.parameters()]
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    opt.step()
                assert opt.metrics()["skipped"]
                changed = [not torch.equal(p, q) for p, q in zip(model.parameters(), before)]
                assert any(changed), "no CPU update landed: the test no longer covers the case"
            else:
                opt.step()
        if not poisoned:
            opt.flush()
        opt.close()
        return model

    assert max_diff(run(True), run(False)) == 0.0


@pytest.mark.parametrize("mode", ["dense", "zero_offload", "zenflow"])
def test_parameters_frozen_when_added_hold_no_state(mode):
    # PEFT/LoRA loops pass model.parameters() with the base weights frozen; torch.optim.AdamW keeps
    # no state for them. ZenFlowAdamW registers the trainable ones only: the same host memory as an
    # optimizer given those alone, the same training; a frozen uint8 weight (a quantized base) is
    # no error; a frozen parameter that gets a gradient later is named before anything changes.
    def frozen_model():
        m = make_model()
        m.emb.weight.requires_grad_(False)
        m.fc1.requires_grad_(False)
        m.quantized = nn.Parameter(torch.zeros(64, 64, dtype=torch.uint8), requires_grad=False)
        return m

    def optimizer(params):
        return ZenFlowAdamW(params, mode=mode, topk_ratio=0.25, update_interval=2, **HYPER)

    a, b = frozen_model(), frozen_model()
    with optimizer(a.parameters()) as all_params, \
            optimizer([p for p in b.parameters() if p.requires_grad]) as trainable:
        for step in range(6):
            train_step(a, all_params, step)
            train_step(b, trainable, step)
        assert all_params.host_memory() == trainable.host_memory()
        assert max_diff(a, b) == 0.0
        sd = all_params.state_dict()
        with pytest.raises(ValueError, match=r"param: was frozen"):
            all_params.gpu_columns(a.fc1.weight)
        a.fc1.requires_grad_(True)  # unfrozen after the optimizer registered its parameters
        before = copy.deepcopy(a.state_dict())
        with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[\d+\] \(param_groups\[0\]\.params\["
                                             r"\d+\]\): has a gradient, but it was frozen"):
            train_step(a, all_params, 6)
        assert all(torch.equal(before[k], v) for k, v in a.state_dict().items())
        a.fc1.requires_grad_(False)
        a.fc1.zero_grad(set_to_none=True)
        with optimizer(a.parameters()) as resumed:  # a state dict of the same parameters loads
            resumed.load_state_dict(sd)
            train_step(a, resumed, 6)
            train_step(b, trainable, 6)
            assert max_diff(a, b) == 0.0


@pytest.mark.parametrize("mode", ["zero_offload", "dense"])
def test_parameters_without_gradient_are_skipped(mode):
    # An unused branch (fc_unused) and a frozen layer, as torch.optim.AdamW handles them.
    ref, ours = make_model(), make_model()
    for m in (ref, ours):
        torch.manual_seed(3)  # the same initial values in both models
        m.fc_unused = nn.Linear(4, 4)
        m.norm.weight.requires_grad_(False)
    ref_opt = torch.optim.AdamW(ref.parameters(), **HYPER)
    with ZenFlowAdamW(ours.parameters(), mode=mode, **HYPER) as opt:
        unused = ours.fc_unused.weight.detach().clone()
        for step in range(50):
            train_step(ref, ref_opt, step)
            train_step(ours, opt, step)
            assert max_diff(ref, ours) <= TRACK_TOL
        assert torch.equal(ours.fc_unused.weight, unused)
