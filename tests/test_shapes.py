"""Tests for the bundled shapes dataset generator and the trained ShapesCNN."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from layertap.shapes import (
    CLASSES,
    MEAN,
    STD,
    WEIGHTS_PATH,
    ShapesBatch,
    ShapesCNN,
    ShapesDataset,
    generate,
    load_shapes_model,
    preprocess,
    save_images,
)

# Seeds not used by scripts/train_shapes.py (it trains on seeds 1000..1000+epochs).
ACC_SEED = 424242
CAM_SEED = 31337


@pytest.fixture(scope="module")
def model() -> ShapesCNN:
    return load_shapes_model()


# ------------------------------------------------------------------ generator


def test_generate_is_deterministic_per_seed() -> None:
    a, b, c = generate(40, seed=3), generate(40, seed=3), generate(40, seed=4)
    for field in ("images", "labels", "boxes", "masks"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
    assert not np.array_equal(a.images, c.images)
    assert not np.array_equal(a.boxes, c.boxes)


@pytest.mark.parametrize("size", [64, 32])
def test_generate_shapes_and_dtypes(size: int) -> None:
    n = 30
    batch = generate(n, seed=1, size=size)
    assert isinstance(batch, ShapesBatch)
    assert len(batch) == n
    assert batch.images.shape == (n, size, size, 3) and batch.images.dtype == np.uint8
    assert batch.labels.shape == (n,) and batch.labels.dtype == np.int64
    assert batch.boxes.shape == (n, 4) and np.issubdtype(batch.boxes.dtype, np.integer)
    assert batch.masks.shape == (n, size, size) and batch.masks.dtype == bool
    assert batch.classes == CLASSES and 5 <= len(CLASSES) <= 8
    assert batch.labels.min() >= 0 and batch.labels.max() < len(CLASSES)
    assert batch.names == [CLASSES[i] for i in batch.labels]


def test_generate_covers_all_classes_and_varied_backgrounds() -> None:
    batch = generate(300, seed=5)
    counts = np.bincount(batch.labels, minlength=len(CLASSES))
    assert counts.min() >= 300 / len(CLASSES) / 2
    # Backgrounds are textured, not flat: lots of variation away from the shape.
    bg = batch.images.astype(np.float32)[~batch.masks]
    assert bg.std() > 30
    per_image_std = np.array(
        [batch.images[i][~batch.masks[i]].astype(np.float32).std(axis=0).mean() for i in range(len(batch))]
    )
    assert np.median(per_image_std) > 5


def test_boxes_are_tight_around_the_shape() -> None:
    size = 64
    batch = generate(200, seed=7, size=size)
    x0, y0, x1, y1 = batch.boxes.T
    assert (x0 >= 0).all() and (y0 >= 0).all() and (x1 <= size).all() and (y1 <= size).all()
    assert (x1 - x0 >= 6).all() and (y1 - y0 >= 6).all()
    for i in range(len(batch)):
        mask = batch.masks[i]
        ys, xs = np.nonzero(mask)
        assert mask.sum() > 20
        # Tight box: inclusive-exclusive bounds of the shape's pixels.
        assert (xs.min(), ys.min(), xs.max() + 1, ys.max() + 1) == tuple(batch.boxes[i])


def test_shape_contrasts_with_the_background_around_it() -> None:
    batch = generate(200, seed=8)
    img = batch.images.astype(np.float32) / 255
    dists = []
    for i in range(len(batch)):
        mask = batch.masks[i]
        x0, y0, x1, y1 = batch.boxes[i]
        around = np.zeros_like(mask)
        around[max(y0 - 3, 0) : y1 + 3, max(x0 - 3, 0) : x1 + 3] = True
        around &= ~mask
        dists.append(np.linalg.norm(img[i][mask].mean(0) - img[i][around].mean(0)))
    dists = np.array(dists)
    # The generator keeps the shape colour >= 0.45 from the background under it.
    assert np.quantile(dists, 0.02) > 0.2
    assert np.median(dists) > 0.4


def test_generate_is_fast() -> None:
    import time

    start = time.process_time()  # CPU time: robust to other work sharing the cores
    generate(1000, seed=9)
    assert time.process_time() - start < 5.0  # typically well under a second


# ------------------------------------------------------------- preprocessing


def test_preprocess_normalises_and_accepts_several_inputs() -> None:
    images = generate(3, seed=11).images
    x = preprocess(images)
    assert x.shape == (3, 3, 64, 64) and x.dtype == torch.float32
    expected = (images.astype(np.float32) / 255 - np.array(MEAN, np.float32)) / np.array(STD, np.float32)
    np.testing.assert_allclose(x.permute(0, 2, 3, 1).numpy(), expected, rtol=0, atol=1e-5)
    one = preprocess(images[1])
    assert one.shape == (1, 3, 64, 64)
    torch.testing.assert_close(one[0], x[1])
    torch.testing.assert_close(preprocess(list(images)), x)
    with pytest.raises(ValueError):
        preprocess(np.zeros((2, 64, 64), np.uint8))


def test_preprocess_accepts_pil_images() -> None:
    Image = pytest.importorskip("PIL.Image")
    images = generate(2, seed=12).images
    pil = Image.fromarray(images[0])
    torch.testing.assert_close(preprocess(pil), preprocess(images[0]))
    torch.testing.assert_close(preprocess([Image.fromarray(im) for im in images]), preprocess(images))


def test_dataset_items_and_loader() -> None:
    ds = ShapesDataset(20, seed=13)
    ref = generate(20, seed=13)
    assert len(ds) == 20 and ds.classes == CLASSES
    np.testing.assert_array_equal(ds.images, ref.images)
    np.testing.assert_array_equal(ds.boxes, ref.boxes)
    x, y = ds[4]
    assert isinstance(y, int) and y == ref.labels[4]
    assert x.shape == (3, 64, 64) and x.dtype == torch.float32
    torch.testing.assert_close(x, preprocess(ref.images[4])[0])
    xb, yb = next(iter(torch.utils.data.DataLoader(ds, batch_size=8)))
    assert xb.shape == (8, 3, 64, 64)
    assert yb.tolist() == ref.labels[:8].tolist()


def test_save_images_png_round_trip(tmp_path) -> None:
    Image = pytest.importorskip("PIL.Image")
    batch = generate(12, seed=14)
    paths = save_images(batch, tmp_path / "out")
    assert len(paths) == 12
    for i, path in enumerate(paths):
        assert path.is_file() and path.suffix == ".png"
        assert path.parent.name == CLASSES[batch.labels[i]]
        assert path.parent.parent == tmp_path / "out"
        with Image.open(path) as im:
            np.testing.assert_array_equal(np.asarray(im.convert("RGB")), batch.images[i])
    assert len(set(paths)) == 12


def test_save_images_jpg(tmp_path) -> None:
    Image = pytest.importorskip("PIL.Image")
    batch = generate(6, seed=15)
    paths = save_images(batch, tmp_path, format="jpg")
    for i, path in enumerate(paths):
        assert path.is_file() and path.suffix == ".jpg"
        assert path.parent.name == CLASSES[batch.labels[i]]
        with Image.open(path) as im:
            pixels = np.asarray(im.convert("RGB")).astype(np.float32)
        assert np.abs(pixels - batch.images[i]).mean() < 12  # lossy but close
    with pytest.raises(ValueError):
        save_images(batch, tmp_path, format="bmp")


# --------------------------------------------------------------------- model


def test_architecture_has_named_blocks_and_inplace_relu() -> None:
    net = ShapesCNN()
    names = dict(net.named_modules())
    for name in ("features.block1", "features.block2", "features.block3", "features.block4", "pool", "classifier"):
        assert name in names
    relus = [m for m in net.modules() if isinstance(m, nn.ReLU)]
    assert relus and all(m.inplace for m in relus)
    assert any(isinstance(m, nn.BatchNorm2d) for m in net.modules())
    assert isinstance(net.pool, nn.AdaptiveAvgPool2d)
    fmap = net.features(torch.zeros(1, 3, 64, 64))
    assert fmap.shape[-1] >= 8 and fmap.shape[-2] >= 8
    assert sum(p.numel() for p in net.parameters()) < 750_000


def test_bundled_weights_are_a_small_plain_state_dict() -> None:
    assert WEIGHTS_PATH.is_file()
    assert WEIGHTS_PATH.stat().st_size < 3 * 1024 * 1024
    state = torch.load(WEIGHTS_PATH, map_location="cpu", weights_only=True)
    assert isinstance(state, dict) and all(isinstance(v, torch.Tensor) for v in state.values())
    assert set(state) == set(ShapesCNN().state_dict())


def test_load_shapes_model(model: ShapesCNN) -> None:
    assert isinstance(model, ShapesCNN)
    assert not model.training
    assert model.classes == CLASSES
    assert model.input_size == (3, 64, 64)
    assert model.mean == MEAN and model.std == STD
    assert next(model.parameters()).device.type == "cpu"


def test_bundled_model_accuracy(model: ShapesCNN) -> None:
    batch = generate(1000, seed=ACC_SEED)
    with torch.inference_mode():
        pred = torch.cat([model(x).argmax(1) for x in preprocess(batch.images).split(250)])
    accuracy = (pred.numpy() == batch.labels).mean()
    assert accuracy >= 0.95, f"accuracy {accuracy:.3f}"
    # Every class is recognised, not just most of them.
    for k in range(len(CLASSES)):
        assert (pred.numpy()[batch.labels == k] == k).mean() >= 0.85, CLASSES[k]


def _reference_grad_cam(model: nn.Module, layer: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-autograd Grad-CAM for the predicted class; returns (cam [N, H, W], pred)."""
    store: dict[str, torch.Tensor] = {}

    def forward_hook(module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        store["act"] = output
        output.register_hook(lambda grad: store.__setitem__("grad", grad))

    handle = layer.register_forward_hook(forward_hook)
    try:
        with torch.enable_grad():
            logits = model(x.requires_grad_(True))
            pred = logits.argmax(1)
            logits.gather(1, pred[:, None]).sum().backward()
    finally:
        handle.remove()
    act, grad = store["act"].detach(), store["grad"]
    weights = grad.mean(dim=(2, 3), keepdim=True)
    cam = F.relu((weights * act).sum(1, keepdim=True))
    cam = F.interpolate(cam, size=x.shape[-2:], mode="bilinear", align_corners=False)[:, 0]
    return cam, pred


def test_grad_cam_pointing_game(model: ShapesCNN) -> None:
    batch = generate(300, seed=CAM_SEED)
    cam, _ = _reference_grad_cam(model, model.features.block4, preprocess(batch.images))
    assert cam.shape == (300, 64, 64)
    flat = cam.flatten(1).argmax(1).numpy()
    ys, xs = flat // 64, flat % 64
    x0, y0, x1, y1 = batch.boxes.T
    inside = (xs >= x0) & (xs < x1) & (ys >= y0) & (ys < y1)
    assert inside.mean() >= 0.90, f"pointing game {inside.mean():.3f}"
    # Sanity check that the game is not trivial: a fixed point (the centre) scores far lower.
    centre = (x0 <= 32) & (x1 > 32) & (y0 <= 32) & (y1 > 32)
    assert centre.mean() < inside.mean() - 0.3
