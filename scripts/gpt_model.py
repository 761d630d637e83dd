"""The small GPT-shaped model and training loop of ``scripts/bench_tiers.py``.

A module of its own, importing torch only, so that ``scripts/resume_child.py`` can build the
same model in a fresh process for a peer that must not pay for importing cas.
"""

from __future__ import annotations

from typing import Any

import torch


class GPT(torch.nn.Module):
    """A small decoder-only transformer: what a language-model checkpoint holds."""

    def __init__(self, vocab: int, width: int, layers: int, heads: int, context: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.position = torch.nn.Parameter(torch.zeros(context, width))
        self.blocks = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(
                width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True
            )
            for _ in range(layers)
        )
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, vocab)

    def features(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        out: torch.Tensor = self.norm(x)
        return out

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.head(self.features(tokens))
        return logits


SIZES = {
    "full": {"vocab": 2048, "width": 128, "layers": 2, "heads": 4, "context": 32, "batch": 4},
    "quick": {"vocab": 256, "width": 32, "layers": 1, "heads": 2, "context": 16, "batch": 2},
    # Resume only: a frozen-backbone checkpoint of 84 MB, where the bytes, not fixed costs, count.
    "large": {"vocab": 8192, "width": 512, "layers": 4, "heads": 8, "context": 32, "batch": 4},
}


class Loop:
    """A model, its optimizer and one batch: ``step()`` is a training step."""

    def __init__(self, size: dict[str, int], *, frozen_backbone: bool = False) -> None:
        torch.manual_seed(0)
        self.size = size
        self.model = GPT(size["vocab"], size["width"], size["layers"], size["heads"],
                         size["context"])  # fmt: skip
        self.task: torch.nn.Module | None = None
        if frozen_backbone:  # a classifier trained on the frozen pretrained model's features
            self.model.requires_grad_(False)
            self.task = torch.nn.Linear(size["width"], 16)
            self.model.add_module("task", self.task)
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(trainable, lr=1e-3)
        self.tokens = torch.randint(0, size["vocab"], (size["batch"], size["context"]))
        self.labels = torch.randint(0, 16, (size["batch"],))

    def step(self) -> None:
        loss: Any
        if self.task is not None:
            pooled = self.model.features(self.tokens).mean(dim=1)
            loss = torch.nn.functional.cross_entropy(self.task(pooled), self.labels)
        else:
            logits = self.model(self.tokens)
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), self.tokens[:, 1:].reshape(-1)
            )
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()

    def state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.opt.state_dict()}
