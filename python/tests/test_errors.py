"""Bad input: a clear exception naming the argument, and nothing changed."""

import copy

import pytest
import torch
from torch import nn

from zenflow.torch import ZenFlowAdamW, ZenFlowError, cuda_available, cuda_status, deepspeed_options
from conftest import batch, make_model, train_step


def loss_of(model, step=0):
    tokens, labels = batch(step)
    return nn.functional.cross_entropy(model(tokens), labels)


@pytest.mark.parametrize("kwargs,argument", [
    (dict(lr=-1.0), "lr"),
    (dict(lr=float("nan")), "lr"),
    (dict(betas=(0.9, 1.0)), "betas"),
    (dict(eps=0.0), "eps"),
    (dict(weight_decay=-0.1), "weight_decay"),
    (dict(amsgrad=True), "amsgrad"),
    (dict(maximize=True), "maximize"),
    (dict(capturable=True), "capturable"),
    (dict(differentiable=True), "differentiable"),
    (dict(fused="yes"), "fused"),
    (dict(mode="adam"), "mode"),
    (dict(topk_ratio=0.0), "topk_ratio"),
    (dict(topk_ratio=1.5), "topk_ratio"),
    (dict(select_strategy="sometimes"), "select_strategy"),
    (dict(select_interval=0), "select_interval"),
    (dict(update_interval="often"), "update_interval"),
    (dict(full_warm_up_rounds=-1), "full_warm_up_rounds"),
    (dict(overlap_step="yes"), "overlap_step"),
    (dict(cover_cpu_update=1), "cover_cpu_update"),
    (dict(cover_cpu_update=True, update_interval=4), "cover_cpu_update: lengthens \"auto\""),
    (dict(cover_cpu_update=True, overlap_step=False), "cover_cpu_update: needs overlap_step"),
    (dict(max_grad_norm=-1.0), "max_grad_norm"),
    (dict(gradient_accumulation_steps=0), "gradient_accumulation_steps"),
    (dict(cpu_threads=-1), "cpu_threads"),
    (dict(column_dim=2), "column_dim"),
])
def test_bad_options(model, kwargs, argument):
    with pytest.raises(ValueError, match=argument):
        ZenFlowAdamW(model.parameters(), **kwargs)


def test_options_the_library_rejects_name_the_field(model):
    # select_interval smaller than update_interval: checked by zenflow_options::validate, at construction.
    with pytest.raises(ZenFlowError, match="select_interval"):
        ZenFlowAdamW(model.parameters(), select_interval=2, update_interval=4)


def test_unsupported_dtype():
    model = make_model().double()
    with pytest.raises(ValueError, match=r"params: emb\.weight|params: param_groups\[0\]\.params\[0\].*float64"):
        ZenFlowAdamW(model.parameters())


def test_param_with_gaps_in_memory():
    # Every other column of a buffer: no memory order makes it dense (a transposed matrix or a
    # channels_last weight would be taken).
    w = nn.Parameter(torch.randn(8, 8)[:, ::2])
    with pytest.raises(ValueError, match=r"params: .* is not dense in memory \(shape \(8, 4\), strides \(8, 2\)"):
        ZenFlowAdamW([w])
    w = nn.Parameter(torch.randn(4, 5, 6).permute(1, 0, 2))  # dense, but its rows are not
    with pytest.raises(ValueError, match=r"params: .* is not dense in memory"):
        ZenFlowAdamW([w])


def test_unsupported_device():
    w = nn.Parameter(torch.randn(8, 4, device="meta"))
    with pytest.raises(ValueError, match="params: .* meta"):
        ZenFlowAdamW([w])


def test_cuda_tensor_without_cuda_backend():
    if cuda_available():
        pytest.skip("this build has the CUDA backend")
    assert "CUDA backend was not built" in cuda_status()
    if not torch.cuda.is_available():
        pytest.skip("no GPU to put a tensor on")
    w = nn.Parameter(torch.randn(8, 4, device="cuda"))
    with pytest.raises(ValueError, match="built without its CUDA backend"):
        ZenFlowAdamW([w])


def test_mixed_devices():
    if not torch.cuda.is_available() or not cuda_available():
        pytest.skip("needs a GPU and the CUDA backend")
    a = nn.Parameter(torch.randn(8, 4))
    b = nn.Parameter(torch.randn(8, 4, device="cuda"))
    with pytest.raises(ValueError, match="params: all parameters must be on one device"):
        ZenFlowAdamW([a, b])


@pytest.mark.parametrize("in_backward", [False, True])
def test_sparse_gradient(in_backward):
    emb = nn.Embedding(10, 4, sparse=True)
    opt = ZenFlowAdamW(emb.parameters(), column_dim=0, submit_in_backward=in_backward)
    emb(torch.tensor([1, 2])).sum().backward()
    before = emb.weight.detach().clone()
    with pytest.raises(ValueError, match=r"grad: .*sparse"):
        opt.step()
    assert torch.equal(emb.weight, before)
    opt.close()


def test_replaced_parameter_storage(model):
    opt = ZenFlowAdamW(model.named_parameters())
    train_step(model, opt, 0)
    model.fc1.weight.data = model.fc1.weight.data.clone()
    loss_of(model).backward()
    with pytest.raises(ValueError, match="fc1.weight's storage was replaced"):
        opt.step()
    opt.close()


def test_add_param_group_after_first_step(model):
    opt = ZenFlowAdamW([model.fc1.weight, model.fc1.bias])
    loss_of(model).backward()
    opt.step()  # registers the parameters
    with pytest.raises(ValueError, match="add_param_group"):
        opt.add_param_group({"params": [model.fc2.weight]})
    opt.close()


def test_a_beta_out_of_range_set_during_training_is_rejected_before_anything_changes(model):
    # Schedules may change betas (OneCycleLR's momentum cycle); a value Adam cannot use is named.
    opt = ZenFlowAdamW(model.parameters(), mode="zero_offload")
    train_step(model, opt, 0)
    opt.param_groups[0]["betas"] = (1.0, 0.999)
    loss_of(model).backward()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=r"param_groups\[0\]\.betas\[0\]"):
        opt.step()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    opt.close()


def test_load_state_dict_mismatch():
    a, b = make_model(), make_model()
    oa = ZenFlowAdamW(a.parameters(), mode="zero_offload")
    train_step(a, oa, 0)
    sd = oa.state_dict()
    ob = ZenFlowAdamW(b.parameters(), mode="dense")
    with pytest.raises(ValueError, match="state_dict: was written in mode"):
        ob.load_state_dict(sd)
    # Same mode, other parameters: the library rejects the checkpoint; the optimizer is unchanged.
    c = nn.Linear(3, 3)
    oc = ZenFlowAdamW(c.parameters(), mode="zero_offload")
    with pytest.raises(ValueError):
        oc.load_state_dict(sd)
    with pytest.raises(ValueError, match="state_dict: has no zenflow checkpoint"):
        oc.load_state_dict(torch.optim.AdamW(c.parameters()).state_dict())
    for o in (oa, ob, oc):
        o.close()


def test_deepspeed_config():
    block = {"topk_ratio": 0.05, "select_strategy": "auto", "select_interval": "auto", "update_interval": 4,
             "full_warm_up_rounds": "auto", "overlap_step": True}
    assert deepspeed_options(block) == {"mode": "zenflow", "topk_ratio": 0.05, "select_strategy": "auto",
                                        "select_interval": "auto", "update_interval": 4, "overlap_step": True}
    whole = {"train_batch_size": 16, "gradient_clipping": 1.0, "gradient_accumulation_steps": "auto",
             "optimizer": {"type": "AdamW", "params": {"lr": 2e-5, "betas": [0.9, 0.98], "eps": "auto",
                                                       "weight_decay": 0.01}},
             "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "zenflow": block}}
    model = make_model()
    opt = ZenFlowAdamW.from_deepspeed(model.parameters(), whole)
    assert opt.options["topk_ratio"] == 0.05 and opt.options["update_interval"] == 4
    assert opt.options["max_grad_norm"] == 1.0
    assert opt.param_groups[0]["lr"] == 2e-5 and opt.param_groups[0]["betas"] == (0.9, 0.98)
    opt.close()
    offload = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    assert deepspeed_options(offload) == {"mode": "zero_offload"}
    # betas given as the config's numbers, in a list or a tuple, agree with it
    with ZenFlowAdamW(make_model().parameters(), betas=[0.9, 0.98], zenflow_config=whole) as o:
        assert o.param_groups[0]["betas"] == (0.9, 0.98)
    assert deepspeed_options({"optimizer": {"params": {"lr": 1e-3, "amsgrad": False, "bias_correction": True}}}) == \
        {"mode": "dense", "lr": 1e-3}
    with pytest.warns(UserWarning, match="torch_adam select DeepSpeed's Adam implementation"):
        assert deepspeed_options({"optimizer": {"params": {"torch_adam": True}}}) == {"mode": "dense"}
    with pytest.raises(ValueError, match="zenflow: unknown key"):
        deepspeed_options({"topk_ratio": 0.1, "top_k": 3})
    with pytest.raises(ValueError, match="optimizer.type"):
        deepspeed_options({"optimizer": {"type": "SGD"}})
    with pytest.raises(ValueError, match="topk_ratio: 0.2 contradicts"):
        ZenFlowAdamW(make_model().parameters(), topk_ratio=0.2, zenflow_config=block)
    compact = dict(block, cpu_state="blockwise8_moments")
    assert deepspeed_options(compact)["cpu_state"] == "blockwise8_moments"
    with ZenFlowAdamW(make_model().parameters(), zenflow_config=compact) as o:
        assert o.cpu_state == "blockwise8_moments"
    with pytest.raises(ValueError, match="cpu_state: 'bf16_moments' contradicts"):
        ZenFlowAdamW(make_model().parameters(), cpu_state="bf16_moments", zenflow_config=compact)
    with pytest.raises(ValueError, match="cpu_state: must be one of"):
        ZenFlowAdamW(make_model().parameters(), zenflow_config=dict(block, cpu_state="int4"))
    covering = dict(block, update_interval="auto", cover_cpu_update=True)
    assert deepspeed_options(covering)["cover_cpu_update"] is True
    with ZenFlowAdamW(make_model().parameters(), zenflow_config=covering) as o:
        assert o.options["cover_cpu_update"] is True
    with pytest.raises(ValueError, match="cover_cpu_update: lengthens"):
        ZenFlowAdamW(make_model().parameters(), zenflow_config=dict(block, cover_cpu_update=True))


@pytest.mark.parametrize("edit", ["append", "replace", "remove"])
@pytest.mark.parametrize("steps_before", [0, 2])
def test_a_parameter_list_edited_after_it_was_added_is_rejected(edit, steps_before):
    # torch.optim steps whatever param_groups hold; ZenFlowAdamW registered its parameters as they
    # were added, so an edited list is an error naming where, before anything changes.
    model = make_model()
    opt = ZenFlowAdamW(model.parameters())
    for step in range(steps_before):
        train_step(model, opt, step)
    extra = nn.Parameter(torch.ones(4, 4))
    params = opt.param_groups[0]["params"]
    if edit == "append":
        params.append(extra)
    elif edit == "replace":
        params[3] = extra
    else:
        del params[3]
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    loss = loss_of(model) + (extra.sum() if edit != "remove" else 0.0)
    loss.backward()
    where = {"append": len(params) - 1, "replace": 3, "remove": 3}[edit]
    with pytest.raises(ValueError, match=rf"param_groups\[0\]\['params'\]\[{where}\]: the group's parameter list "
                                         rf"changed"):
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert torch.equal(extra, torch.ones(4, 4))
    opt.close()
