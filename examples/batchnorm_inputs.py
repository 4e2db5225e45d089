"""Scenario (c): the input of every BatchNorm2d in three torchvision architectures.

Inputs are captured before the layer runs, so they equal the output of the conv before them.
Run: python examples/batchnorm_inputs.py
"""

import torch
import torchvision
from torch import nn

import layertap

for arch in ("resnet50", "mobilenet_v3_large", "efficientnet_b0"):
    model = getattr(torchvision.models, arch)().eval()
    with torch.no_grad(), layertap.tap(model, nn.BatchNorm2d, capture="input", reduce="mean") as taps:
        model(torch.randn(2, 3, 128, 128))
    widths = sorted({v.shape[1] for v in taps.inputs.values()})
    print(f"{arch:20s} {len(taps.inputs):3d} BatchNorm2d inputs, channel widths {widths[0]}..{widths[-1]}")
