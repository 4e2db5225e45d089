"""Tutorial scenario (a): record fc1's output on every forward and fc2's output gradient.

The hand-written version needs a hook class, a list, and a full backward hook; here it is two taps.
Run: python examples/mlp_record.py
"""

import torch
from torch import nn

import layertap

model = nn.Sequential()
model.add_module("fc1", nn.Linear(784, 256))
model.add_module("relu", nn.ReLU(inplace=True))
model.add_module("fc2", nn.Linear(256, 10))

with layertap.tap(model, "fc1", keep="all") as acts, layertap.tap(model, "fc2", capture="grad") as grads:
    for _ in range(3):
        y = model(torch.randn(1, 784))
    y.backward(torch.ones(1, 10))

print(f"fc1 recorded on {len(acts['fc1'])} forwards, each {tuple(acts['fc1'][0].shape)}")
print(f"gradient at fc2's output: {grads.grads['fc2']}")
assert not model._forward_hooks and not model.fc1._forward_hooks  # nothing left behind
