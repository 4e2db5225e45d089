"""Statistics while a model trains: `layertap.watch` names the layer whose scale explodes.

A small CNN (the bundled shapes architecture, random init, 8 channels wide) is trained on the
bundled shapes data twice for 60 steps, sampled every 5th step: with a sane learning rate
(no alert), then with a learning rate 100 times too large. The second run's alerts name the
first layer, in the order the forward ran, whose output's std grew past 100x its value at
step 0, and the layers that went dead. Every sampled step's statistics go to a CSV file.

Run: python examples/watch_training.py    (about 10 s on 2 CPU cores)
"""

import csv
import tempfile
from pathlib import Path

import torch
from torch import nn

from layertap.shapes import ShapesCNN, generate, preprocess
from layertap.watch import CSV, watch

data = generate(512, seed=1)
images, labels = preprocess(data.images), torch.as_tensor(data.labels)
folder = Path(tempfile.mkdtemp())

for lr in (0.05, 5.0):
    torch.manual_seed(0)
    model = ShapesCNN(width=8)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    table = folder / f"watch_lr{lr}.csv"
    print(f"--- learning rate {lr}")
    # on_alert: print each alert as it comes (without it, alerts are WatchWarnings);
    # optimizer=: every optimizer.step() is a step, no w.step() needed
    with watch(model, every=5, sinks=[CSV(table)], optimizer=optimizer, on_alert=print) as w:
        for step in range(60):
            batch = slice(step * 32 % 512, step * 32 % 512 + 32)
            loss = nn.functional.cross_entropy(model(images[batch]), labels[batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    with table.open() as f:
        rows = list(csv.DictReader(f))
    conv = [r for r in rows if r["name"] == "features.block2.conv" and r["kind"] == "output"]
    print(f"final loss {loss.item():.3f}; {len(w.alerts)} alerts; {table}: {len(rows)} rows")
    print("  features.block2.conv output std by step:", ", ".join(f"{r['step']}: {float(r['std']):.3g}" for r in conv))
