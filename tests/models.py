"""Small models that several test files share."""

from torch import nn


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
