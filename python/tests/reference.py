"""What the training-loop tests compare against: torch.optim.AdamW, and how close is close.

A tiny BERT classifier (2 layers, hidden 32, no dropout) built from a config, a learnable task
(the label is the first token mod 4), and the tolerance within which ZenFlowAdamW in dense and
ZeRO-Offload mode must follow torch.optim.AdamW, both from the same seed on the same data:

  max |zenflow - torch foreach| <= max(max |torch foreach - torch fused|, 2 ulp(W)) + 2 ulp(W) * decay steps

over every element (but the attention key biases, below), with W the largest weight magnitude of
the model. The first term is torch's
own implementation noise, measured in the same test (foreach and fused AdamW order their float32
operations differently, and training amplifies such differences the same way for any optimizer:
an attention key bias, whose gradient is zero but for rounding, walks wherever its rounding noise
sends it), with a floor of two float32 ulps at the scale of the weights, below which two
implementations cannot be told apart. The second term is the one documented way zenflow's Adam
differs from torch's (include/zenflow/adam_math.hpp): torch first rounds p * (1 - lr * weight_decay)
(with 1 - lr * weight_decay itself rounded to float32) and then adds the update, rounding p twice
per step; zenflow forms the whole change of p and rounds once. That is at most one ulp of p per
step from torch's extra rounding and one from where the final rounding lands: two ulps per step
that applied a weight decay. Without weight decay the bound is torch's own noise alone.

The attention key biases are left out of the comparison: softmax is invariant to the shift they
add to a query's scores, so their gradient is zero but for rounding, and Adam turns that rounding
noise into steps of about lr, whichever implementation rounds (their distance between torch's two
implementations is noise too, and is left out of the tolerance alike).
"""

import copy

import torch
from transformers import BertConfig, BertForSequenceClassification

VOCAB, CLASSES, SEQ = 64, 4, 12
ULP = 2.0 ** -23  # float32: ulp(x) <= ULP * |x|
_NOISE_ONLY = "attention.self.key.bias"  # a gradient that is rounding noise (see above)


def tiny_bert(seed=0, initializer_range=0.1):
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=16, num_labels=CLASSES,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                        initializer_range=initializer_range)
    return BertForSequenceClassification(config)


_BASE = {}


def model(initializer_range=0.1):
    """A fresh copy of the same initial model. By default its weights are initialised large enough
    that gradient norms exceed 1 (so that clipping at 1 changes the gradients); BERT's own 0.02
    for the runs that compare how well optimizers train."""
    if initializer_range not in _BASE:
        _BASE[initializer_range] = tiny_bert(initializer_range=initializer_range)
    return copy.deepcopy(_BASE[initializer_range])


def standard_model():
    return model(0.02)


def batch(step, n=8):
    """Batch `step` of the task: token sequences labelled by their first token mod 4."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    return x, x[:, 0] % CLASSES


class Dataset(torch.utils.data.Dataset):
    """The task as a map-style dataset of dicts (transformers.Trainer, DataLoader)."""

    def __init__(self, n=2048, seed=1):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randint(0, VOCAB, (n, SEQ), generator=g)
        self.y = self.x[:, 0] % CLASSES

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.y[i]}


def accuracy(m):
    """Held-out accuracy (512 sequences not trained on)."""
    g = torch.Generator().manual_seed(99)
    x = torch.randint(0, VOCAB, (512, SEQ), generator=g)
    with torch.no_grad():
        return (m(input_ids=x).logits.argmax(1) == x[:, 0] % CLASSES).float().mean().item()


def torch_adamw(params, kind, **hyper):
    """torch.optim.AdamW, its foreach or its fused implementation."""
    return torch.optim.AdamW(params, foreach=kind == "foreach", fused=kind == "fused", **hyper)


def check_follows_torch(ours, foreach, fused, decay_steps, what, trained=True):
    """`ours` within the module's tolerance of `foreach`, measured against `fused` (see the module's
    docstring); `decay_steps`: the steps that applied a nonzero weight decay. Returns the largest
    difference and the tolerance."""
    reference = {n: p.detach() for n, p in foreach.named_parameters() if not n.endswith(_NOISE_ONLY)}
    noise = max((reference[n] - p.detach()).abs().max().item() for n, p in fused.named_parameters() if n in reference)
    ulp = ULP * max(p.abs().max().item() for p in reference.values())
    tolerance = max(noise, 2 * ulp) + 2 * ulp * decay_steps
    differences = {n: (p.detach() - reference[n]).abs().max().item() for n, p in ours.named_parameters()
                   if n in reference}
    where = max(differences, key=differences.get)
    if trained:  # else one step, from weights that trained
        initial = dict(model().named_parameters())
        moved = max((p - initial[n]).abs().max().item() for n, p in reference.items())
        assert moved > 20 * tolerance, f"{what}: the reference did not train ({moved} against {tolerance})"
    assert differences[where] <= tolerance, (
        f"{what}: {where} differs from torch's AdamW by {differences[where]:.3g}, tolerance {tolerance:.3g} (torch's "
        f"foreach-vs-fused difference {noise:.3g}, ulp of the largest weight {ulp:.3g}, {decay_steps} decay steps)")
    return differences[where], tolerance
