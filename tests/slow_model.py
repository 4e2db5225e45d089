"""A small CNN that says which process starts each batch, and takes its time over it: for runs
that tests kill in the middle. Tests import it; their subprocesses run it as a script, or load it
as the model spec ``slow_model:slow`` (with this folder on ``PYTHONPATH``)."""

import os
import sys
import time

import torch

import layertap


class Slow(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 16, 3))
        self.pool = torch.nn.AdaptiveAvgPool2d(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # one write per line: the lines of several processes sharing a pipe do not mix
        sys.stdout.write(f"batch {os.environ.get('RANK', '0')} {os.getpid()}\n")
        sys.stdout.flush()
        time.sleep(0.15)
        return self.pool(self.conv(x))


def slow() -> Slow:
    return Slow()


if __name__ == "__main__":
    data, out, fmt = sys.argv[1:4]
    layertap.extract_dataset(Slow(), data, ["conv", "pool"], out, format=fmt, batch_size=4, chunk_size=8, progress=False)
