import pytest
import torch
from torch import nn


class Tiny(nn.Module):
    """Embedding -> Linear -> LayerNorm -> GELU -> Linear: every kind of parameter the optimizer sees."""

    def __init__(self, vocab=40, dim=16, hidden=32, classes=4):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.fc2 = nn.Linear(hidden, classes)

    def forward(self, tokens):
        return self.fc2(nn.functional.gelu(self.norm(self.fc1(self.emb(tokens).mean(1)))))


def make_model(seed=0):
    torch.manual_seed(seed)
    return Tiny()


def batch(step, n=32, seq=6, vocab=40, classes=4):
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, vocab, (n, seq), generator=g)
    labels = tokens[:, 0] % classes
    return tokens, labels


def train_step(model, opt, step):
    tokens, labels = batch(step)
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(tokens), labels)
    loss.backward()
    opt.step()
    return loss.item()


def max_diff(a, b):
    return max((p.detach().float() - q.detach().float()).abs().max().item()
               for p, q in zip(a.parameters(), b.parameters()))


@pytest.fixture
def model():
    return make_model()
