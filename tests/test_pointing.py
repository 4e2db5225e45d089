"""The pointing game, and every CAM method playing it on freshly generated shapes."""

import numpy as np
import pytest
import torch

from layertap import cam
from layertap.cam.pointing import (
    peaks,
    pointing_game,
    pointing_hits,
    pointing_scores,
)
from layertap.errors import LayertapError
from layertap.shapes import generate, load_shapes_model

N_IMAGES = 200
SCORECAM_IMAGES = 16  # a forward per channel and image (128 per image): the slow method gets fewer


def test_pointing_game_against_planted_peaks():
    rng = np.random.default_rng(0)
    n, h, w = 300, 24, 32
    x0, y0 = rng.integers(0, w - 1, n), rng.integers(0, h - 1, n)
    boxes = np.stack([x0, y0, np.minimum(x0 + rng.integers(1, 12, n), w), np.minimum(y0 + rng.integers(1, 12, n), h)], 1)
    # one planted maximum per map: inside its box for half of them, anywhere for the others
    px, py = rng.integers(0, w, n), rng.integers(0, h, n)
    px[::2], py[::2] = rng.integers(boxes[::2, 0], boxes[::2, 2]), rng.integers(boxes[::2, 1], boxes[::2, 3])
    maps = rng.uniform(0, 0.5, (n, h, w))
    maps[np.arange(n), py, px] = 1.0
    expected = [b[0] <= x < b[2] and b[1] <= y < b[3] for x, y, b in zip(px, py, boxes)]
    assert 100 < sum(expected) < n - 100  # both hits and misses are exercised
    assert peaks(maps).tolist() == np.stack([px, py], 1).tolist()
    assert pointing_hits(maps, boxes).tolist() == expected
    assert pointing_game(torch.from_numpy(maps), torch.from_numpy(boxes)) == pytest.approx(np.mean(expected))


def test_box_edges_blank_and_nan_maps():
    maps = np.zeros((5, 8, 8))
    maps[0, 2, 2] = 1  # on the box's first row and column: inside
    maps[1, 2, 6] = 1  # on x1, which is exclusive: outside
    maps[3, 3, 3] = np.nan  # NaN is never the maximum
    maps[3, 4, 4] = 1
    maps[4, 5, 5] = 1
    boxes = [[2, 2, 6, 6]] * 5
    # map 2 is blank: it points nowhere, even though its first pixel's box would hold it
    boxes[2] = [0, 0, 8, 8]
    assert pointing_hits(maps, boxes).tolist() == [True, False, False, True, True]


def test_bad_shapes_are_explained():
    with pytest.raises(LayertapError, match=r"maps \[N, H, W\] and boxes \[N, 4\]"):
        pointing_game(np.zeros((2, 8, 8)), [[0, 0, 1, 1]])
    with pytest.raises(LayertapError, match="unknown CAM methods"):
        pointing_scores(4, methods=["gradcamm"])


@pytest.fixture(scope="module")
def model():
    return load_shapes_model()


@pytest.fixture(scope="module")
def scores(model):
    found = pointing_scores(N_IMAGES, model=model, methods=[m for m in cam.METHODS if m != "scorecam"])
    found.update(pointing_scores(SCORECAM_IMAGES, model=model, methods=["scorecam"]))
    print("\npointing game of each method:", {k: f"{100 * v:.1f}%" for k, v in found.items()})
    return found


def baselines(n: int) -> dict[str, float]:
    """What maps that ignore the image score: a peak at the centre (shapes are big and kept inside
    the image, so their boxes often hold the centre: about 0.7), a peak at random (about 0.2)."""
    batch = generate(n, seed=7)
    size = batch.images.shape[1]
    centre = np.zeros((n, size, size))
    centre[:, size // 2, size // 2] = 1
    rng = np.random.default_rng(0)
    return {"centre": pointing_game(centre, batch.boxes), "random": pointing_game(rng.random((n, size, size)), batch.boxes)}


def test_gradcam_points_at_the_shape(scores):
    assert scores["gradcam"] >= 0.90


def test_every_method_beats_image_blind_maps(scores):
    blind = max(baselines(N_IMAGES).values())
    assert set(scores) == set(cam.METHODS)
    for method, score in scores.items():
        assert score > blind + 0.1, f"{method}: {score:.2f} vs image-blind {blind:.2f}"

