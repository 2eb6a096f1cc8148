"""The GPT of ``examples/gpt.py`` written in torch, cut into pipeline stages.

Same architecture as the Flax model: token + position embedding, pre-LN blocks
(causal multi-head attention without biases, a tanh-GELU MLP of width 4·d), final
layer norm and a bias-free head; next-token cross-entropy, Adam.  Used by
``benchmarks/peer_torch_pipe.py`` to run the same model on
``torch.distributed.pipelining``.
"""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    """Pre-LN transformer block: causal self-attention then a GELU MLP, both residual."""

    def __init__(self, d_model: int, num_heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model, eps=1e-6)
        self.attn = nn.MultiheadAttention(d_model, num_heads, bias=False, batch_first=True)
        self.ln2 = nn.LayerNorm(d_model, eps=1e-6)
        self.fc1 = nn.Linear(d_model, 4 * d_model)
        self.fc2 = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq = x.shape[1]
        mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)
        h = self.ln1(x)
        h, _ = self.attn(h, h, h, attn_mask=mask, need_weights=False)
        x = x + h
        h = self.fc2(nn.functional.gelu(self.fc1(self.ln2(x)), approximate="tanh"))
        return x + h


class Embed(nn.Module):
    """Token plus position embedding (the first stage's head)."""

    def __init__(self, vocab: int, d_model: int, max_len: int):
        super().__init__()
        self.wte = nn.Embedding(vocab, d_model)
        self.wpe = nn.Embedding(max_len, d_model)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1])[None, :]
        return self.wte(tokens) + self.wpe(pos)


class Head(nn.Module):
    """Final layer norm and the output projection (the last stage's tail)."""

    def __init__(self, vocab: int, d_model: int):
        super().__init__()
        self.ln_f = nn.LayerNorm(d_model, eps=1e-6)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln_f(x))


def build_gpt(
    vocab: int, d_model: int, num_heads: int, num_layers: int, max_len: int, seed: int = 0
) -> nn.Sequential:
    """The whole model as a sequence: embed, ``num_layers`` blocks, head."""
    torch.manual_seed(seed)
    parts = [Embed(vocab, d_model, max_len)]
    parts += [Block(d_model, num_heads) for _ in range(num_layers)]
    parts.append(Head(vocab, d_model))
    return nn.Sequential(*parts)


def stage_modules(model: nn.Sequential, num_stages: int) -> list[nn.Sequential]:
    """Cut ``model`` into ``num_stages`` pieces with equal numbers of blocks; the
    embedding joins the first piece and the head the last (as meshshard's boundaries
    after every block group do).

    Raises ValueError when the blocks do not divide evenly.
    """
    blocks = list(model)[1:-1]
    if len(blocks) % num_stages:
        raise ValueError(
            f"num_stages={num_stages} does not divide the {len(blocks)} blocks; "
            "pick a stage count that divides num_layers"
        )
    per = len(blocks) // num_stages
    pieces = [list(blocks[i * per : (i + 1) * per]) for i in range(num_stages)]
    pieces[0].insert(0, model[0])
    pieces[-1].append(model[-1])
    return [nn.Sequential(*p) for p in pieces]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy."""
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
