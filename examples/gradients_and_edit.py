"""Gradients at a layer with in-place ReLUs after it, and an ablation with edit=.

Run: python examples/gradients_and_edit.py
"""

import torch
import torchvision

import layertap

model = torchvision.models.resnet50().eval()
x = torch.randn(2, 3, 128, 128)

# the gradient of class 3's score with respect to layer4's output (a Grad-CAM ingredient)
with layertap.tap(model, "layer4", capture=("output", "grad")) as t:
    model(x)[:, 3].sum().backward()
weights = t.grads["layer4"].mean((2, 3))  # one weight per channel
cam = torch.relu((weights[:, :, None, None] * t["layer4"]).sum(1))
print(f"layer4 {tuple(t['layer4'].shape)}, heatmap {tuple(cam.shape)}")


# ablate half of layer3's channels and see how much the logits move
def ablate(name, out):
    out = out.clone()
    out[:, : out.shape[1] // 2] = 0
    return out


with torch.no_grad():
    base = model(x)
    with layertap.tap(model, "layer3", edit=ablate):
        ablated = model(x)
print(f"mean |logit change| after ablating half of layer3: {(base - ablated).abs().mean():.4f}")
