"""The loops users run, on CPU torch, with ZenFlowAdamW where torch.optim.AdamW was:
transformers.Trainer (default arguments, clipping on; gradient accumulation; a linear warm-up
schedule; a run resumed from its own checkpoint), an accelerate loop (prepare, clip_grad_norm_,
accumulate), a Lightning module, fp16 autocast with torch.amp.GradScaler skipping steps,
iterations interrupted between backward and step, and torch.distributed.checkpoint's optimizer
state dict taken mid-run. In dense and ZeRO-Offload mode ZenFlowAdamW follows torch's AdamW within
reference.py's tolerance (torch's own foreach-vs-fused difference, measured in each test) over a
short run (fp16: step by step from the same weights, see there); over a run long enough for every
optimizer to learn the task (150 steps), ZenFlow, async and sync, reaches torch's held-out
accuracy within one point (early on it trails: only the selected columns are updated every step).
"""

import os
import tempfile
import warnings

import pytest
import torch

from reference import Dataset, accuracy, batch, check_follows_torch, model, standard_model, torch_adamw
from zenflow.torch import ZenFlowAdamW, param_groups

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ZENFLOW = {"zenflow_async": dict(topk_ratio=0.1, update_interval=4, select_interval=20),
           "zenflow_sync": dict(topk_ratio=0.1, update_interval=4, select_interval=20, overlap_step=False)}


def close(opt):
    if isinstance(opt, ZenFlowAdamW):
        opt.close()  # writes pending CPU work back first


_torch_runs = {}  # torch's runs, shared by the tests that differ in ZenFlowAdamW's options only


def check_loop(loop, hyper, steps, decay_steps, zenflow=(), in_backward=False, accuracy_steps=150):
    """Runs `loop(make_optimizer, steps, build_model)` with torch's AdamW (foreach, fused) and
    ZenFlowAdamW in dense and ZeRO-Offload mode (reference.model: gradient norms above 1); then
    `accuracy_steps` steps with torch's AdamW and each mode of `zenflow` (BERT's initialisation). make_optimizer(model) builds the optimizer over the usual fine-tuning groups
    (param_groups: no decay on biases and norms, embeddings' columns are embeddings)."""
    lr, decay = hyper["lr"], hyper["weight_decay"]

    def torch_optimizer(kind):
        return lambda m: torch_adamw(param_groups(m, weight_decay=decay), kind, lr=lr)

    def zenflow_optimizer(**options):
        return lambda m: ZenFlowAdamW(param_groups(m, weight_decay=decay), lr=lr, **options)

    def torch_run(kind, n, build=model):
        key = (loop.__name__, kind, n, lr, decay, build.__name__)
        if key not in _torch_runs:
            _torch_runs[key] = loop(torch_optimizer(kind), n, build)
        return _torch_runs[key]

    foreach, fused = torch_run("foreach", steps), torch_run("fused", steps)
    for mode in ("dense", "zero_offload"):
        # The defaults, or the hand-over in backward.
        ours = loop(zenflow_optimizer(mode=mode, **({"submit_in_backward": True} if in_backward else {})), steps)
        check_follows_torch(ours, foreach, fused, decay_steps, mode)
    if zenflow:
        reached = accuracy(torch_run("foreach", accuracy_steps, standard_model))
        assert reached > 0.95, f"torch's AdamW reached {reached}: the task did not train"
        for name in zenflow:
            got = accuracy(loop(zenflow_optimizer(**ZENFLOW[name]), accuracy_steps, standard_model))
            assert got >= reached - 0.01, f"{name}: held-out accuracy {got} against torch's {reached}"


# -- transformers.Trainer ----------------------------------------------------------------------

def trainer_loop(make, max_steps, build=model, **arguments):
    from transformers import Trainer, TrainingArguments
    m = build()
    opt = make(m)
    with tempfile.TemporaryDirectory() as d:
        args = TrainingArguments(output_dir=d, per_device_train_batch_size=8, report_to="none", save_strategy="no",
                                 logging_strategy="no", disable_tqdm=True, use_cpu=True, max_steps=max_steps,
                                 **arguments)
        Trainer(model=m, args=args, train_dataset=Dataset(), optimizers=(opt, None)).train()
    close(opt)
    return m


@pytest.mark.parametrize("in_backward", [False, True])
def test_trainer_with_default_arguments(in_backward):
    # Its defaults: lr 5e-5, no weight decay, max_grad_norm 1.0 (clip_grad_norm_ between backward
    # and step), a linear decay schedule. With the gradients handed over in backward the clipping
    # changes them afterwards: step() notices (version counters), hands them over again, warns.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_loop(trainer_loop, dict(lr=5e-5, weight_decay=0.0), 12, 0, in_backward=in_backward)
    handed_again = [w for w in caught if "handed over again" in str(w.message)]
    assert len(handed_again) == (2 if in_backward else 0)  # once per optimizer (dense, zero_offload)


def test_trainer_with_gradient_accumulation():
    def accumulating(make, steps, build=model):
        return trainer_loop(make, steps, build, gradient_accumulation_steps=4)
    check_loop(accumulating, dict(lr=5e-5, weight_decay=0.0), 8, 0)


def test_trainer_with_a_linear_warm_up_schedule():
    def warming_up(make, steps, build=model):
        return trainer_loop(make, steps, build, warmup_steps=10)
    check_loop(warming_up, dict(lr=3e-3, weight_decay=0.01), 30, 30, zenflow=("zenflow_async", "zenflow_sync"))


@pytest.mark.parametrize("mode", ["torch", "dense", "zero_offload", "zenflow_async", "zenflow_sync"])
def test_trainer_resumed_from_its_checkpoint_ends_where_the_uninterrupted_run_ends(mode):
    # Trainer(save_strategy="steps") writes the model, then optimizer.state_dict() and the
    # scheduler's; train(resume_from_checkpoint=...) with a new model and optimizer loads all three
    # and skips the batches already seen. Saved at step 6, in the middle of a ZenFlow interval
    # (update_interval 4) with a CPU update pending: the resumed run must end on the uninterrupted
    # run's weights, bit for bit, as torch's AdamW does.
    from transformers import Trainer, TrainingArguments
    options = {"dense": dict(mode="dense"), "zero_offload": dict(mode="zero_offload"),
               "zenflow_async": dict(ZENFLOW["zenflow_async"], select_interval=5),
               "zenflow_sync": dict(ZENFLOW["zenflow_sync"], select_interval=5)}

    def run(output_dir, resume=None):
        m = model()
        gs = param_groups(m, weight_decay=0.01)
        opt = torch_adamw(gs, "foreach", lr=3e-3) if mode == "torch" else ZenFlowAdamW(gs, lr=3e-3, **options[mode])
        args = TrainingArguments(output_dir=output_dir, per_device_train_batch_size=8, report_to="none",
                                 save_strategy="steps", save_steps=6, logging_strategy="no", disable_tqdm=True,
                                 use_cpu=True, max_steps=15, warmup_steps=3)
        Trainer(model=m, args=args, train_dataset=Dataset(), optimizers=(opt, None)).train(
            resume_from_checkpoint=resume)
        close(opt)
        return m

    with tempfile.TemporaryDirectory() as d1, tempfile.TemporaryDirectory() as d2:
        uninterrupted = run(d1)
        run(d2)  # writes checkpoint-6 and checkpoint-12
        resumed = run(d2, resume=os.path.join(d2, "checkpoint-6"))
    for (name, a), b in zip(uninterrupted.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), name


# -- accelerate --------------------------------------------------------------------------------

def accelerate_loop(make, steps, build=model, accumulate=2):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accumulate)
    m = build()
    opt = make(m)
    loader = torch.utils.data.DataLoader(Dataset(), batch_size=8)
    pm, popt, loader = accelerator.prepare(m, opt, loader)
    done = 0
    for b in loader:
        with accelerator.accumulate(pm):
            accelerator.backward(pm(**b).loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(pm.parameters(), 1.0)
            popt.step()
            popt.zero_grad()
        done += accelerator.sync_gradients
        if done == steps:
            break
    close(opt)
    return accelerator.unwrap_model(pm)


def test_accelerate_loop():
    check_loop(accelerate_loop, dict(lr=3e-3, weight_decay=0.01), 20, 20, zenflow=("zenflow_async",))


# -- Lightning ---------------------------------------------------------------------------------

def lightning_loop(make, steps, build=model):
    import lightning

    class Classifier(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = build()

        def training_step(self, b, index):
            return self.net(**b).loss

        def configure_optimizers(self):
            self.opt = make(self.net)
            return self.opt

    module = Classifier()
    trainer = lightning.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=1.0)
    trainer.fit(module, torch.utils.data.DataLoader(Dataset(), batch_size=8))
    close(module.opt)
    return module.net


def test_lightning_module():
    check_loop(lightning_loop, dict(lr=3e-3, weight_decay=0.01), 20, 20, zenflow=("zenflow_async",))


# -- fp16 with GradScaler ------------------------------------------------------------------------

OVERFLOW_AT = (3, 7)


def grad_scaler_step(m, opt, scaler, step):
    """One step of the usual GradScaler recipe (fp16 autocast on CPU, unscale_, clipping); at the
    overflow steps a gradient holds an infinity: the scaler skips optimizer.step() and halves its
    scale. Returns whether it skipped, after checking that the weights stayed as they were then."""
    x, y = batch(step)
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = m(input_ids=x, labels=y).loss
    scaler.scale(loss).backward()
    if step in OVERFLOW_AT:
        m.classifier.weight.grad[0, 0] = float("inf")
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
    scale = scaler.get_scale()
    before = [p.detach().clone() for p in m.parameters()]
    scaler.step(opt)
    scaler.update()
    skipped = scaler.get_scale() < scale
    if skipped:
        assert all(torch.equal(b, p) for b, p in zip(before, m.parameters()))
    return skipped


def grad_scaler_loop(make, steps, build=model):
    m = build()
    opt = make(m)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    skipped = [s for s in range(steps) if grad_scaler_step(m, opt, scaler, s)]
    assert skipped == [s for s in OVERFLOW_AT if s < steps]
    close(opt)
    return m


def test_fp16_grad_scaler_with_skipped_steps():
    # fp16 activations turn a one-ulp difference of an fp32 weight into a different fp16 rounding
    # of it, and that into a different gradient: whole runs of two Adams that round differently
    # drift apart far faster than torch's foreach and fused AdamW, which round alike here. So the
    # comparison runs in lockstep: every model starts each step from torch foreach's weights (for
    # ZenFlowAdamW an edit it adopts), the optimizers keep their own moments and step counts, and
    # after each step every model is within reference.py's tolerance of one step of torch's.
    lr, decay = 3e-3, 0.01
    makers = {"foreach": lambda m: torch_adamw(param_groups(m, weight_decay=decay), "foreach", lr=lr),
              "fused": lambda m: torch_adamw(param_groups(m, weight_decay=decay), "fused", lr=lr)}
    for mode in ("dense", "zero_offload"):
        makers[mode] = lambda m, mode=mode: ZenFlowAdamW(param_groups(m, weight_decay=decay), lr=lr, mode=mode)
    models = {k: model() for k in makers}
    opts = {k: make(models[k]) for k, make in makers.items()}
    scalers = {k: torch.amp.GradScaler("cpu", init_scale=2.0 ** 10) for k in makers}
    for step in range(12):
        with torch.no_grad():
            for k in makers:
                for p, q in zip(models[k].parameters(), models["foreach"].parameters()):
                    p.copy_(q)
        skipped = {grad_scaler_step(models[k], opts[k], scalers[k], step) for k in makers}
        assert skipped == {step in OVERFLOW_AT}
        for mode in ("dense", "zero_offload"):
            check_follows_torch(models[mode], models["foreach"], models["fused"], 1, f"{mode}, step {step}",
                                trained=False)
    for opt in opts.values():
        close(opt)
    # The whole run, for ZenFlow: as well trained as with torch's AdamW.
    reached = accuracy(grad_scaler_loop(makers["foreach"], 150, standard_model))
    got = accuracy(grad_scaler_loop(lambda m: ZenFlowAdamW(param_groups(m, weight_decay=decay), lr=lr,
                                                           **ZENFLOW["zenflow_async"]), 150, standard_model))
    assert reached > 0.95 and got >= reached - 0.01, (got, reached)


# -- an iteration interrupted between backward and step --------------------------------------------

def interrupted_loop(make, steps, build=model, interrupted=(4, 9)):
    m = build()
    opt = make(m)
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        try:
            m(input_ids=x, labels=y).loss.backward()
            if step in interrupted:
                raise RuntimeError("simulated: out of memory between backward and step")
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            opt.step()
        except RuntimeError as e:
            if "simulated" not in str(e):
                raise
    close(opt)
    return m


@pytest.mark.parametrize("in_backward", [False, True])
def test_interrupted_iterations(in_backward):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # in_backward: the clipping after the hand-over warns
        check_loop(interrupted_loop, dict(lr=3e-3, weight_decay=0.01), 20, 18, zenflow=("zenflow_async",),
                   in_backward=in_backward)


@pytest.mark.parametrize("mode", ["dense", "zenflow"])
def test_a_dcp_get_optimizer_state_dict_does_not_step_the_optimizer(mode):
    # torch.distributed.checkpoint's get_optimizer_state_dict steps an optimizer whose `state` is
    # empty once, with zero gradients and lr 0, to create its state; ZenFlowAdamW's state lives in
    # the library, and that step would have advanced its step count and decayed its moments. The
    # dict it returns has no "zenflow" entry: loading it says so, and says what to save instead.
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    def run(with_dcp):
        m = model()
        opt = ZenFlowAdamW(m.parameters(), lr=1e-2, mode=mode, update_interval=2, select_interval=4)
        osd = None
        for step in range(8):
            x, y = batch(step)
            opt.zero_grad()
            m(input_ids=x, labels=y).loss.backward()
            opt.step()
            if step == 3 and with_dcp:
                opt.zero_grad()
                osd = get_optimizer_state_dict(m, opt)
        opt.flush()
        weights = [p.detach().clone() for p in m.parameters()]
        opt.close()
        return weights, osd, m

    reference, _, _ = run(False)
    weights, osd, m = run(True)
    assert all(torch.equal(a, b) for a, b in zip(reference, weights))
    fresh = ZenFlowAdamW(m.parameters(), lr=1e-2, mode=mode, update_interval=2, select_interval=4)
    with pytest.raises(ValueError, match="get_optimizer_state_dict drops that entry: save optimizer.state_dict"):
        set_optimizer_state_dict(m, fresh, osd)
    fresh.close()
