"""Tutorial scenario (b): the output of every Conv2d for a batch of 32 images.

Run: python examples/every_conv.py
"""

import torch
import torchvision
from torch import nn

import layertap

model = torchvision.models.squeezenet1_1().eval()  # random weights: nothing is downloaded
with torch.no_grad(), layertap.tap(model, nn.Conv2d, reduce="mean") as taps:
    model(torch.randn(32, 3, 224, 224))

for name, feature in taps.items():
    print(f"{name:28s} {tuple(feature.shape)}")
print(f"{len(taps)} Conv2d layers, channel means of each kept (reduce='mean')")
