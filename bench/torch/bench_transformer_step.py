"""Training-step time of a transformers causal LM (random weights, built from a config) under
torch.optim.AdamW on the device (the no-offload "dense" reference) and zenflow.torch's
ZenFlowAdamW in ZeRO-Offload, ZenFlow async and ZenFlow sync modes; DeepSpeed's ZenFlow too when
`import deepspeed` works.

    python bench/torch/bench_transformer_step.py --out bench_0.5b.json             # CUDA, Qwen2-0.5B shape
    python bench/torch/bench_transformer_step.py --preset 1.5b --out bench_1.5b.json
    python bench/torch/bench_transformer_step.py --device cpu --preset tiny        # smoke test
    python bench/torch/bench_transformer_step.py --modes torch_adamw,zenflow_async --profile 4  # where time goes

Per mode: step time (forward + backward + optimizer step; CUDA events at the step boundaries,
perf_counter on the CPU; warm-up steps excluded) as median and mean of the timed steps and as a
ratio to dense, the optimizer's stall per step and PCIe bytes per step (ZenFlowAdamW.metrics()),
and the peak GPU memory (torch.cuda.max_memory_allocated). Bars, judged on CUDA only:
ZenFlow async mean step time <= 1.25x dense, ZenFlow async mean stall per step <= 0.15x
ZeRO-Offload's. Nothing is downloaded: the model is built from a config.
"""

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time

import torch

PRESETS = {
    # Qwen2-0.5B's shape (hidden 896, 24 layers, 14 heads, 2 kv heads, intermediate 4864).
    "0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True),
    # Qwen2-1.5B's shape.
    "1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                 intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True),
    # Smoke test (seconds on a CPU).
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=1000, tie_word_embeddings=True),
}

# name -> ZenFlowAdamW keyword arguments; "torch_adamw" and "deepspeed_zenflow" are handled apart.
ZENFLOW_MODES = {
    "zenflow_dense": dict(mode="dense"),
    "zero_offload": dict(mode="zero_offload"),
    "zenflow_async": dict(mode="zenflow", overlap_step=True),
    "zenflow_sync": dict(mode="zenflow", overlap_step=False),
}
ALL_MODES = ("torch_adamw", "zero_offload", "zenflow_async", "zenflow_sync", "zenflow_dense",
             "deepspeed_zenflow")
DEFAULT_MODES = ("torch_adamw", "zero_offload", "zenflow_async", "zenflow_sync", "deepspeed_zenflow")

STEP_BAR = 1.25   # ZenFlow async mean step time / dense
STALL_BAR = 0.15  # ZenFlow async stall per step / ZeRO-Offload's


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--preset", default=None, choices=sorted(PRESETS),
                   help="model shape (default: 0.5b on cuda, tiny on cpu)")
    p.add_argument("--dtype", default=None, choices=("bf16", "fp32"),
                   help="parameter dtype (default: bf16 on cuda, fp32 on cpu)")
    p.add_argument("--batch", type=int, default=None, help="sequences per step (default 4 on cuda, 2 on cpu)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 512 on cuda, 32 on cpu)")
    p.add_argument("--warmup", type=int, default=8, help="untimed steps first (default 8: two intervals of 4)")
    p.add_argument("--steps", type=int, default=32, help="timed steps (default 32: whole update intervals)")
    p.add_argument("--modes", default=",".join(DEFAULT_MODES),
                   help=f"comma-separated, from {', '.join(ALL_MODES)} (default: %(default)s)")
    p.add_argument("--topk-ratio", type=float, default=0.1)
    p.add_argument("--update-interval", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--cpu-threads", type=int, default=0, help="ZenFlowAdamW's CPU Adam threads (0: all)")
    p.add_argument("--reserved-cpus", type=int, default=0,
                   help="ZenFlowAdamW's reserved_cpus: CPUs left to the training loop's own threads (default 0)")
    p.add_argument("--submit-in-backward", action="store_true",
                   help="ZenFlowAdamW hands each gradient over during backward (default: at step())")
    p.add_argument("--attn", default="sdpa", help="transformers attn_implementation (default sdpa)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="after the timed steps, N more under torch.profiler: the top operations and kernels "
                        "by self device time and by self CPU time, per step (not part of the timing)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--quiet", action="store_true")
    a = p.parse_args(argv)
    cuda = a.device == "cuda"
    a.preset = a.preset or ("0.5b" if cuda else "tiny")
    a.dtype = a.dtype or ("bf16" if cuda else "fp32")
    a.batch = a.batch or (4 if cuda else 2)
    a.seq = a.seq or (512 if cuda else 32)
    a.modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    for m in a.modes:
        if m not in ALL_MODES:
            p.error(f"--modes: unknown mode {m!r}; choose from {', '.join(ALL_MODES)}")
    if a.steps < 1 or a.warmup < 0 or a.profile < 0:
        p.error("--steps must be >= 1, --warmup >= 0 and --profile >= 0")
    return a


def build_model(args, device, dtype):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    cfg = Qwen2Config(**PRESETS[args.preset], max_position_embeddings=max(4096, args.seq),
                      attn_implementation=args.attn, use_cache=False)
    torch.manual_seed(args.seed)
    with torch.device(device):  # initialized where it runs: a 1.5B fp32 init on the CPU is slow
        model = Qwen2ForCausalLM(cfg).to(dtype=dtype)
    model.train()
    return model


def synthetic_batch(args, vocab, device):
    g = torch.Generator().manual_seed(args.seed + 1)
    return torch.randint(0, vocab, (args.batch, args.seq), generator=g).to(device)


class StepTimer:
    """Step-boundary timestamps: CUDA events on the current stream, else perf_counter."""

    def __init__(self, cuda):
        self.cuda = cuda
        self.marks = []

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.marks.append(e)
        else:
            self.marks.append(time.perf_counter())

    def seconds(self):
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])]
        return [b - a for a, b in zip(self.marks, self.marks[1:])]


def deepspeed_engine(model, args):
    """A single-process DeepSpeed engine with ZeRO stage 2, CPU optimizer offload and the
    zero_optimization.zenflow block (keys as in DeepSpeed's ZenFlow tutorial)."""
    import deepspeed
    for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                 ("MASTER_PORT", "29511")):
        os.environ.setdefault(k, v)
    config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": args.dtype == "bf16"},
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.999], "eps": 1e-8,
                                                  "weight_decay": args.weight_decay}},
        "zero_optimization": {
            "stage": 2,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "zenflow": {"topk_ratio": args.topk_ratio, "select_strategy": "auto", "select_interval": "auto",
                        "update_interval": args.update_interval, "full_warm_up_rounds": 0,
                        "overlap_step": True},
        },
        "steps_per_print": 1 << 30,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine, config


def run_mode(name, args, device, dtype):
    import zenflow.torch as zf
    cuda = device.type == "cuda"
    model = build_model(args, device, dtype)
    if cuda:  # the peak counts the model, optimizer and steps, not the fp32 initialization
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    n_params = sum(p.numel() for p in model.parameters())
    ids = synthetic_batch(args, model.config.vocab_size, device)
    result = {"mode": name, "parameters": n_params}
    engine = opt = None
    if name == "deepspeed_zenflow":
        engine, ds_config = deepspeed_engine(model, args)
        result["deepspeed_config"] = ds_config
    elif name == "torch_adamw":
        fused = cuda and "fused" in torch.optim.AdamW.__init__.__code__.co_varnames
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay,
                                **({"fused": True} if fused else {}))
        result["fused"] = bool(fused)
    else:
        opt = zf.ZenFlowAdamW(zf.param_groups(model, weight_decay=args.weight_decay), lr=args.lr,
                              weight_decay=args.weight_decay, topk_ratio=args.topk_ratio,
                              update_interval=args.update_interval, cpu_threads=args.cpu_threads,
                              reserved_cpus=args.reserved_cpus,
                              submit_in_backward=args.submit_in_backward, **ZENFLOW_MODES[name])
        result["options"] = dict(opt.options, submit_in_backward=args.submit_in_backward,
                                 reserved_cpus=args.reserved_cpus)
    metrics = []
    losses = []
    timer = StepTimer(cuda)
    wall0 = None

    def one_step():
        if engine is not None:
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
        else:
            opt.zero_grad(set_to_none=True)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
        return loss

    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            if cuda:
                torch.cuda.synchronize()
            wall0 = time.perf_counter()
            timer.mark()
        loss = one_step()
        if step >= args.warmup:
            timer.mark()
            losses.append(loss.detach())
            if isinstance(opt, zf.ZenFlowAdamW):
                metrics.append(opt.metrics())
    seconds = timer.seconds()
    wall = time.perf_counter() - wall0  # timer.seconds() synchronized
    result.update({
        "step_ms_median": 1e3 * statistics.median(seconds),
        "step_ms_mean": 1e3 * statistics.fmean(seconds),
        "step_ms_min": 1e3 * min(seconds),
        "step_ms_max": 1e3 * max(seconds),
        "wall_ms_per_step": 1e3 * wall / args.steps,
        "loss_last": float(losses[-1].float().item()),
        "peak_gpu_memory_bytes": int(torch.cuda.max_memory_allocated()) if cuda else None,
    })
    if metrics:
        n = len(metrics)
        stall = [m.get("stall_seconds", 0.0) for m in metrics]
        d2h = sum(m.get("bytes_device_to_host", 0) for m in metrics) / n
        h2d = sum(m.get("bytes_host_to_device", 0) for m in metrics) / n
        result.update({
            "stall_ms_per_step": 1e3 * sum(stall) / n,
            "stall_ms_max": 1e3 * max(stall),
            "cpu_update_ms_per_step": 1e3 * sum(m.get("cpu_update_seconds", 0.0) for m in metrics) / n,
            "bytes_d2h_per_step": d2h,
            "bytes_h2d_per_step": h2d,
            "pcie_bytes_per_step": d2h + h2d,
            "interval_last": metrics[-1].get("interval"),
            "stall_reasons": sorted({str(m.get("stall_reason")) for m in metrics if m.get("stall_seconds", 0) > 0}),
        })
    if args.profile:
        result["profile"] = profile_steps(one_step, args.profile, cuda)
    if opt is not None and hasattr(opt, "close"):
        opt.close()
    del engine, opt, model, ids, losses
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return result


def profile_steps(one_step, steps, cuda, top=15):
    """`steps` more steps under torch.profiler. Per step: the operations and kernels with the most
    self device time (kernels and copies on every stream, so concurrent streams add up) and the most
    self CPU time, and their totals."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            one_step()
        if cuda:
            torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        device_us = getattr(e, "self_device_time_total", None)
        if device_us is None:  # torch before 2.4
            device_us = getattr(e, "self_cuda_time_total", 0)
        rows.append({"name": e.key, "calls_per_step": e.count / steps,
                     "self_device_ms": device_us / 1e3 / steps, "self_cpu_ms": e.self_cpu_time_total / 1e3 / steps})
    return {
        "steps": steps,
        "self_device_ms_total": sum(r["self_device_ms"] for r in rows),
        "self_cpu_ms_total": sum(r["self_cpu_ms"] for r in rows),
        "top_device": sorted((r for r in rows if r["self_device_ms"] > 0), key=lambda r: -r["self_device_ms"])[:top],
        "top_cpu": sorted(rows, key=lambda r: -r["self_cpu_ms"])[:top],
    }


def say_profile(say, name, prof):
    say(f"  {name}: profile of {prof['steps']} step(s), per step: self device {prof['self_device_ms_total']:.2f} ms "
        f"(streams added up), self CPU {prof['self_cpu_ms_total']:.2f} ms")
    for title, key, rows in (("device", "self_device_ms", prof["top_device"]), ("CPU", "self_cpu_ms", prof["top_cpu"])):
        for r in rows:
            say(f"    {title:6s} {r[key]:9.3f} ms  x{r['calls_per_step']:<7.4g} {r['name'][:90]}")


def judge(results, cuda):
    """The bars as {name: {"value", "bar", "verdict"}}; verdict PASS, FAIL, "not judged on CPU" or why not."""
    dense = results.get("torch_adamw", {}).get("step_ms_mean")
    zo = results.get("zero_offload", {})
    za = results.get("zenflow_async", {})
    out = {}
    step_ratio = za["step_ms_mean"] / dense if dense and "step_ms_mean" in za else None
    stall_ratio = None
    if "stall_ms_per_step" in za and zo.get("stall_ms_per_step"):
        stall_ratio = za["stall_ms_per_step"] / zo["stall_ms_per_step"]
    for key, value, bar, needs in (("zenflow_async_step_over_dense", step_ratio, STEP_BAR,
                                    "torch_adamw and zenflow_async"),
                                   ("zenflow_async_stall_over_zero_offload", stall_ratio, STALL_BAR,
                                    "zenflow_async and zero_offload (with a stall > 0)")):
        if not cuda:
            verdict = "not judged on CPU"
        elif value is None:
            verdict = f"not judged: needs {needs}"
        else:
            verdict = "PASS" if value <= bar else "FAIL"
        out[key] = {"value": value, "bar": bar, "verdict": verdict}
    return out


def fmt(v, spec):
    return format(v, spec) if isinstance(v, (int, float)) and v is not None else "-"


def run(argv=None):
    """Runs the benchmark; returns (and with --out writes) the results as a dict."""
    args = parse_args(argv)
    say = (lambda *a: None) if args.quiet else (lambda *a: print(*a, flush=True))
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device (use --device cpu for the smoke test)")
    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    cuda = device.type == "cuda"
    import transformers
    import zenflow.torch as zf
    offload = [m for m in args.modes if m in ZENFLOW_MODES]
    if cuda and offload and not zf.cuda_available():
        raise SystemExit(f"--modes {','.join(offload)} on cuda need zenflow.torch's CUDA backend: "
                         f"{zf.cuda_status()} (see python/README.md, Build)")
    env = {"torch": torch.__version__, "transformers": transformers.__version__,
           "zenflow_cuda": zf.cuda_status(), "device": args.device,
           "gpu": torch.cuda.get_device_name(device) if cuda else None,
           "cpu_count": os.cpu_count(), "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    say(f"preset {args.preset} ({args.dtype}), batch {args.batch} x seq {args.seq}, "
        f"{args.warmup} warm-up + {args.steps} timed steps, topk_ratio {args.topk_ratio}, "
        f"update_interval {args.update_interval}; {args.device}"
        + (f" ({env['gpu']})" if cuda else ""))
    results, skipped = {}, {}
    for name in args.modes:
        if name == "deepspeed_zenflow":
            if not cuda:
                skipped[name] = "DeepSpeed ZenFlow needs CUDA; skipped on CPU"
                say(f"{name}: {skipped[name]}")
                continue
            try:
                import deepspeed  # noqa: F401
            except Exception as e:  # noqa: BLE001 -- any import failure means: not available
                skipped[name] = f"deepspeed not available ({type(e).__name__}: {e}); skipped"
                say(f"{name}: {skipped[name]}")
                continue
            try:
                results[name] = run_mode(name, args, device, dtype)
            except Exception as e:  # noqa: BLE001 -- DeepSpeed's failure is reported, not fatal
                skipped[name] = f"DeepSpeed ZenFlow failed: {type(e).__name__}: {e}"
                say(f"{name}: {skipped[name]}")
                gc.collect()
                if cuda:
                    torch.cuda.empty_cache()
                continue
        else:
            results[name] = run_mode(name, args, device, dtype)
        r = results[name]
        say(f"  {name:17s} {r['step_ms_median']:9.2f} ms median {r['step_ms_mean']:9.2f} ms mean"
            + (f"  stall {r['stall_ms_per_step']:8.2f} ms/step  PCIe {r['pcie_bytes_per_step'] / 1e6:9.1f} MB/step"
               if "stall_ms_per_step" in r else ""))
        if "profile" in r:
            say_profile(say, name, r["profile"])
    dense = results.get("torch_adamw", {}).get("step_ms_mean")
    for r in results.values():
        r["ratio_to_dense"] = r["step_ms_mean"] / dense if dense else None
    bars = judge(results, cuda)
    say("")
    say(f"{'mode':17s} {'median ms':>10s} {'mean ms':>10s} {'x dense':>8s} {'stall ms':>9s} "
        f"{'d2h MB':>9s} {'h2d MB':>9s} {'peak GiB':>9s}")
    for name, r in results.items():
        say(f"{name:17s} {r['step_ms_median']:10.2f} {r['step_ms_mean']:10.2f} {fmt(r['ratio_to_dense'], '8.3f'):>8s} "
            f"{fmt(r.get('stall_ms_per_step'), '9.2f'):>9s} "
            f"{fmt(r['bytes_d2h_per_step'] / 1e6 if 'bytes_d2h_per_step' in r else None, '9.1f'):>9s} "
            f"{fmt(r['bytes_h2d_per_step'] / 1e6 if 'bytes_h2d_per_step' in r else None, '9.1f'):>9s} "
            f"{fmt(r['peak_gpu_memory_bytes'] / 2**30 if r['peak_gpu_memory_bytes'] is not None else None, '9.2f'):>9s}")
    say("")
    for key, b in bars.items():
        say(f"{b['verdict']}: {key} = {fmt(b['value'], '.3f')} (bar <= {b['bar']})")
    out = {"args": {k: v for k, v in vars(args).items() if k not in ("out", "quiet")},
           "model": dict(PRESETS[args.preset], family="Qwen2ForCausalLM"), "env": env,
           "timing": ("CUDA events at step boundaries" if cuda else "time.perf_counter at step boundaries")
           + "; mean and median over the timed steps; bars on the mean",
           "results": results, "skipped": skipped, "bars": bars}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2, default=str)
        say(f"wrote {args.out}")
    return out


def main(argv=None):
    out = run(argv)
    failed = [k for k, b in out["bars"].items() if b["verdict"] == "FAIL"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
