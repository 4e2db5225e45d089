"""Small models that several test files share."""

import torch
from torch import nn


class MLP(nn.Module):
    """784 -> 256 -> ReLU -> 10."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(784, 256)
        self.relu = nn.ReLU()
        self.fc2 = nn.Linear(256, 10)

    def forward(self, x):
        return self.fc2(self.relu(self.fc1(x)))


class Reordered(nn.Module):
    """Defined in one order, run in another; ``act`` runs twice, ``unused`` never."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(8, 3)
        self.unused = nn.Linear(8, 8)
        self.body = nn.Linear(4, 8)
        self.act = nn.ReLU()

    def forward(self, x):
        return self.head(self.act(self.body(self.act(x))))


def padded_tokens(docs: list[list[int]], side: str) -> dict:
    """Token ids padded on ``side`` into one batch, with the attention mask and position_ids over
    the real tokens (a left-padded document keeps the positions of its run alone)."""
    length = max(map(len, docs))
    ids = torch.zeros(len(docs), length, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, doc in enumerate(docs):
        at = slice(0, len(doc)) if side == "right" else slice(length - len(doc), length)
        ids[i, at], mask[i, at] = torch.tensor(doc), 1
    return {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp(min=0)}
