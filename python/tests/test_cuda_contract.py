"""torch.optim's contract on CUDA tensors (the CUDA backend on torch.cuda.current_stream()): the
gradients as they are at step() after clipping and accumulation, an edit adopted (and winning over
a pending CPU update), an interrupted iteration, a checkpoint resumed bit-identically. Skipped
where there is no GPU or the extension was built without its CUDA backend."""

import copy
import io
import warnings

import pytest
import torch

from reference import accuracy, batch, check_follows_torch, model, standard_model
from zenflow.torch import ZenFlowAdamW, cuda_available, param_groups

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and cuda_available()),
                                reason="needs a GPU and zenflow.torch's CUDA backend")

HYPER = dict(lr=3e-3, weight_decay=0.01)


def loop(make, steps=16, build=model):
    """Clipping, accumulation over 2 backward passes, an edit (clamp) and a rollback, an
    interrupted iteration."""
    m = build().cuda()
    opt = make(m)
    saved = None
    for step in range(steps):
        with torch.no_grad():
            if step == 3:
                saved = copy.deepcopy(m.state_dict())
            if step == 5:
                m.classifier.weight.clamp_(-0.02, 0.02)
            if step == 9:
                m.load_state_dict(saved)
        opt.zero_grad()
        for micro in range(2):
            x, y = batch(2 * step + micro)
            (m(input_ids=x.cuda(), labels=y.cuda()).loss / 2).backward()
        if step == 7:
            continue  # interrupted between backward and step
        torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
        opt.step()
    if isinstance(opt, ZenFlowAdamW):
        opt.close()
    return m.cpu()


def torch_optimizer(kind):
    return lambda m: torch.optim.AdamW(param_groups(m, weight_decay=HYPER["weight_decay"]), lr=HYPER["lr"],
                                       foreach=kind == "foreach", fused=kind == "fused")


@pytest.mark.parametrize("in_backward", [False, True])
def test_dense_and_zero_offload_follow_torch_on_cuda(in_backward):
    foreach, fused = loop(torch_optimizer("foreach")), loop(torch_optimizer("fused"))
    for mode in ("dense", "zero_offload"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ours = loop(lambda m: ZenFlowAdamW(param_groups(m, weight_decay=HYPER["weight_decay"]), lr=HYPER["lr"],
                                               mode=mode, submit_in_backward=in_backward))
        check_follows_torch(ours, foreach, fused, 15, f"cuda {mode}")


def test_zenflow_trains_as_torch_on_cuda():
    def zenflow(m):
        return ZenFlowAdamW(param_groups(m, weight_decay=HYPER["weight_decay"]), lr=HYPER["lr"], topk_ratio=0.1,
                            update_interval=4, select_interval=20)
    reached = accuracy(loop(torch_optimizer("foreach"), 150, standard_model))
    got = accuracy(loop(zenflow, 150, standard_model))
    assert reached > 0.95 and got >= reached - 0.01, (got, reached)


def test_an_edit_wins_over_a_pending_cpu_update_on_cuda():
    m = model().cuda()
    w = m.classifier.weight
    opt = ZenFlowAdamW(m.named_parameters(), topk_ratio=0.25, update_interval=4, select_interval=20, record_trace=True,
                       **HYPER)
    for step in range(8):
        if step == 5:
            with torch.no_grad():
                w.fill_(0.01)
        x, y = batch(step)
        opt.zero_grad()
        m(input_ids=x.cuda(), labels=y.cuda()).loss.backward()
        opt.step()
    torch.cuda.synchronize()
    assert opt.trace()[0]["written_back_at"] == 7
    gpu = opt.gpu_columns(w)
    cpu = [c for c in range(w.shape[1]) if c not in gpu]
    assert torch.all(w[:, cpu] == 0.01)
    assert torch.all(w[:, gpu] != 0.01)
    opt.close()


def test_a_checkpoint_resumes_bit_identically_on_cuda():
    def run(steps, start=0, sd=None):
        m = model().cuda()
        opt = ZenFlowAdamW(m.parameters(), topk_ratio=0.25, update_interval=3, select_interval=9, **HYPER)
        if sd is not None:
            m.load_state_dict(sd["model"])
            opt.load_state_dict(sd["optimizer"])
        for step in range(start, steps):
            x, y = batch(step)
            opt.zero_grad()
            m(input_ids=x.cuda(), labels=y.cuda()).loss.backward()
            opt.step()
        return m, opt
    m, opt = run(10)
    buf = io.BytesIO()
    torch.save({"model": m.state_dict(), "optimizer": opt.state_dict()}, buf)
    for step in range(10, 20):
        x, y = batch(step)
        opt.zero_grad()
        m(input_ids=x.cuda(), labels=y.cuda()).loss.backward()
        opt.step()
    opt.close()
    buf.seek(0)
    resumed, ropt = run(20, 10, torch.load(buf, weights_only=False))
    ropt.close()
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), resumed.parameters()))


@pytest.mark.parametrize("method", [dict(mode="dense"), dict(mode="zero_offload"),
                                    dict(mode="zenflow", topk_ratio=0.25, update_interval=2, select_interval=3)],
                         ids=lambda m: m["mode"])
def test_parameters_in_any_dense_memory_layout_train_as_their_contiguous_twins_on_cuda(method):
    from test_optimizer import Convnet, _in_other_layouts  # the CPU test's model and layouts
    a, b = Convnet().cuda(), _in_other_layouts(Convnet().cuda())
    with ZenFlowAdamW(a.parameters(), **HYPER, **method) as oa, ZenFlowAdamW(b.parameters(), **HYPER, **method) as ob:
        for step in range(8):
            x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(step)).cuda()
            oa.zero_grad()
            a(x).pow(2).mean().backward()
            for p, q in zip(a.parameters(), b.parameters()):  # a's gradients (cuDNN's differ by layout)
                q.grad = torch.empty_like(q).copy_(p.grad)   # in b's layout, as autograd makes them
            oa.step()
            ob.step()
            assert oa.gpu_columns(a.head.weight) == ob.gpu_columns(b.head.weight), step
        oa.flush()
        ob.flush()
        assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
