"""Dataset-scale extraction: run a model over a whole dataset and stream layers' features to disk.

How it stays as fast as the model and as small as one batch:

- one `layertap.tap` is kept for the whole run with ``stop_early=True``, so the network runs only
  up to the last chosen layer, and ``reduce``/``dtype`` shrink features on the device (see
  `layertap.extract.forward`);
- on a GPU, features are copied to the host without blocking, into pinned memory; a background
  thread assembles rows into whole chunks and writes them while the model runs the next batch,
  and takes a new batch only when idle: two batches at most are held, whatever the data (see
  `layertap.extract.sink`);
- chunks are a whole number of batches, so a resumed run cuts the same batches as a full one;
  each chunk's completion marker is written after its data (see `layertap.store`);
- under ``torchrun`` the chunks still to write are dealt out to the processes in turn, and each
  writes its own into the one store (see `layertap.distributed`).

>>> import os, tempfile, torch, torchvision, layertap
>>> model = torchvision.models.resnet18()
>>> data = torch.utils.data.TensorDataset(torch.randn(8, 3, 64, 64), torch.arange(8))
>>> out = os.path.join(tempfile.mkdtemp(), "features.zarr")
>>> store = layertap.extract_dataset(model, data, ["layer3", "avgpool"], out, reduce="mean", progress=False)
>>> store["layer3"].shape, store.labels.tolist()[:3]
((8, 256), [0, 1, 2])

The package, in the order a run goes through it:

- `run`: `extract_dataset`, the run itself: checks the arguments, opens the data and the
  store, deals chunks out to the processes, resumes, and verifies what a resume adds to;
- `forward`: the model under one tap, batch after batch, and the proof that each output is
  batch-first (a store holds one row per sample);
- `sink`: the writer thread, which assembles rows into whole chunks and writes them while the
  model runs the next batch;
- `settings`: what the features depend on (the model's fingerprint, layers, data, transform),
  the metadata record written into the store and compared on resume, and how far recomputed
  rows may differ (``verify=``);
- `tokens`: `extract_tokens`, the same run over a language model's tokens: its rows are the
  chosen tokens of a corpus (`corpus`), tokenized into units (`tokenizer`, `units`) and padded
  into fixed batches (`batches`), so each row is what the model computes for its document alone;
- `plan`: `plan`, a run's plan before it starts: sizes, free space, measured throughput and write
  bandwidth, the projected time and what bounds it, and smaller options;
- `digests`: the fingerprints of the computation and the digests of the samples, with which a
  resumed run proves it computes what the store was written with.

As an attribute of `layertap`, ``layertap.extract`` is the function (`layertap.features.extract`),
bound after this package was imported: reach the package with import statements
(``from layertap.extract import run``), never ``import layertap.extract.run as run``, which looks
the name up on `layertap`. Every submodule is imported here, eagerly, so what the package holds
never depends on what was imported before.
"""

from . import batches, corpus, digests, forward, plan, run, settings, sink, token_plan, tokenizer, tokens, units  # noqa: F401  (every part loaded with the package: see above)
from .plan import Plan
from .run import extract_dataset
from .settings import Verify
from .tokens import extract_tokens

__all__ = ["extract_dataset", "extract_tokens", "Plan", "Verify"]
