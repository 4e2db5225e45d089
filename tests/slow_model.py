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


def quick() -> torch.nn.Module:
    """A model too small to take time: runs killed at random moments land anywhere, writes too."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).eval()


def extract_counting(data: str, out: str, fmt: str, batches) -> None:
    """Extract with `quick`, counting the batches begun in the shared value ``batches``."""
    model = quick()

    def count(module, args):
        with batches.get_lock():
            batches.value += 1

    model.register_forward_pre_hook(count)
    layertap.extract_dataset(model, data, ["1", "3"], out, format=fmt, batch_size=2, chunk_size=4, num_workers=0, progress=False)
