"""As the model saw it: `view_box`, `model_view` and `to_original` against the transforms
themselves (torchvision's, timm's, layertap's) and against positions worked out by hand."""

import functools

import numpy as np
import pytest
import torch
import torchvision.transforms as T
from PIL import Image

import layertap
from layertap.cli import run
from layertap.errors import ArgumentError
from layertap.images import load_image, model_view, to_original, view_box
from layertap.loading import load_model
from layertap.modelinfo import ImageTransform, model_info
from layertap.overlay import UNSEEN_SHADE, overlay
from layertap.shapes import ShapesTransform

NORMALISE = T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))


@functools.cache
def transforms() -> dict:
    """The transforms layertap meets, each as the model gets it."""
    import timm

    return {
        "torchvision preset": model_info(load_model("torchvision:resnet18")).transform,  # resize 256, crop 224
        "timm": model_info(timm.create_model("resnet18")).transform,  # Compose: Resize(235, bicubic), CenterCrop(224)
        "layertap crop": ImageTransform((3, 64, 96)),
        "layertap resize": ImageTransform((3, 64, 96), crop=False),
        "shapes": ShapesTransform((64, 64)),
        "crop larger than the image": T.Compose([T.Resize(40), T.CenterCrop((48, 96)), T.ToTensor(), NORMALISE]),
    }


def unnormalised(transform, image: Image.Image) -> np.ndarray:
    """What ``transform`` gives the model, back in [0, 255]: its normalisation measured pixel by
    pixel and undone (padding, the same in black and white, is black)."""
    black, white = (transform(Image.new("RGB", image.size, c)) for c in ((0, 0, 0), (255, 255, 255)))
    scale = white - black
    return ((transform(image) - black) / scale.where(scale.abs() > 1e-6, 1) * 255).permute(1, 2, 0).numpy()


def smooth(width: int, height: int) -> Image.Image:
    """A non-square picture without fine detail, where two resamplings can only differ a little."""
    noise = np.random.default_rng(0).integers(0, 255, (9, 15, 3), dtype=np.uint8)
    return Image.fromarray(noise).resize((width, height), Image.BICUBIC)


def test_a_hot_pixel_lands_where_the_geometry_says():
    """By hand: a 640x512 image, resized so its short side is 256 (scale 1/2: 320x256), then
    its centre 224x224 cropped at (48, 16). Input pixel (column 50, row 100) has its centre at
    (98.5, 116.5) on the resized image, (197, 233) on the original: the corner where original
    pixels 196-197 and rows 232-233 meet. Bilinear sampling gives each of those four pixels
    0.75 x 0.75 of the hot value, and every other pixel less."""
    transform = model_info(load_model("torchvision:resnet18")).transform
    image = Image.new("RGB", (640, 512))
    assert view_box(transform, image.size).box == (96.0, 32.0, 544.0, 480.0)
    hot = np.zeros((224, 224), np.float32)
    hot[100, 50] = 1
    mapped = to_original(hot, image, transform)
    assert mapped.shape == (512, 640)
    np.testing.assert_allclose(mapped[232:234, 196:198], 0.5625, rtol=1e-6)
    assert np.nanmax(mapped) == pytest.approx(0.5625) and np.nansum(mapped > 0) == 16  # a 4x4 tent
    # outside the centre crop, nothing: NaN, not 0
    assert np.isnan(mapped[:, :96]).all() and np.isnan(mapped[:, 544:]).all() and np.isnan(mapped[:32]).all()
    assert not np.isnan(mapped[32:480, 96:544]).any()


def test_a_hot_pixel_on_a_non_square_image_with_layertap_preprocessing():
    """By hand: 300x180, short side to int(32 / 0.875) = 36 (scale 1/5: 60x36), the centre
    32x32 at (14, 2). Input pixel (20, 5) is centred at (34.5, 7.5) there, (172.5, 37.5) on the
    original: the centre of original pixel (172, 37), which gets the whole hot value."""
    mapped = to_original(np.eye(1, 32 * 32, 5 * 32 + 20).reshape(32, 32), Image.new("RGB", (300, 180)), ImageTransform((3, 32, 32)))
    assert np.unravel_index(np.nanargmax(mapped), mapped.shape) == (37, 172)
    assert mapped[37, 172] == 1 and np.nansum(mapped > 0) == 81  # a 9x9 tent: 5 original pixels per input pixel
    # a thumbnail's size keeps the geometry: a third of the size, the pixel a third of the way
    small = to_original(np.eye(1, 32 * 32, 5 * 32 + 20).reshape(32, 32), Image.new("RGB", (300, 180)), ImageTransform((3, 32, 32)), size=(100, 60))
    assert small.shape == (60, 100) and np.unravel_index(np.nanargmax(small), small.shape) == (12, 57)


@pytest.mark.parametrize("name", list(transforms()))
def test_model_view_is_what_the_transform_gives_the_model(name):
    transform = transforms()[name]
    image = smooth(300, 180)
    seen = np.asarray(model_view(image, transform), dtype=np.float64)
    expected = unnormalised(transform, image)
    assert seen.shape == expected.shape
    # the same resampling: equal but for rounding (a level or two, at a few pixels)
    assert np.abs(seen - expected).max() <= 2.01 and np.abs(seen - expected).mean() < 0.01


@pytest.mark.parametrize("name", list(transforms()))
def test_the_models_view_maps_back_onto_the_original(name):
    """Independent of the geometry code: a bright square, seen through the real transform and
    used as the heatmap, lands back where it was."""
    transform = transforms()[name]
    pixels = np.zeros((180, 300, 3), np.uint8)
    pixels[70:100, 120:170] = 255  # the square: rows 70-99, columns 120-169
    image = Image.fromarray(pixels)
    heat = unnormalised(transform, image)[..., 0] / 255
    mapped = np.nan_to_num(to_original(heat, image, transform))
    rows, cols = np.indices(mapped.shape)
    weight = mapped.sum()
    assert (rows * mapped).sum() / weight == pytest.approx(84.5, abs=0.3)
    assert (cols * mapped).sum() / weight == pytest.approx(144.5, abs=0.3)


@pytest.mark.parametrize("name", list(transforms()))
def test_any_other_transform_is_measured(name):
    """A transform layertap cannot read (here: the same one, hidden in a lambda) is measured
    through coloured probes, to a fraction of a pixel."""
    transform = transforms()[name]
    read = view_box(transform, (300, 180))
    measured = view_box(lambda image: transform(image), (300, 180))
    assert measured.size == read.size
    np.testing.assert_allclose(measured.box, read.box, atol=0.6)


def test_a_transform_that_is_not_geometry_is_refused():
    flip = T.Compose([T.Resize((32, 32)), T.RandomVerticalFlip(1.0), T.ToTensor()])
    with pytest.raises(ArgumentError, match="cannot tell which part of the image"):
        view_box(flip, (50, 40))
    with pytest.raises(ArgumentError, match="not an RGB image tensor"):
        view_box(lambda image: torch.zeros(8), (50, 40))


def test_overlay_draws_on_the_whole_image_and_dims_what_was_not_seen():
    image = smooth(300, 180)
    drawn = np.asarray(overlay(image, np.ones((32, 32)), alpha=0.5, transform=ImageTransform((3, 32, 32)))).astype(int)
    assert drawn.shape == (180, 300, 3)
    original = np.asarray(image).astype(int)
    # the crop is (70, 10)-(230, 170): outside it the image is dimmed, inside it coloured
    assert np.abs(drawn[:, :70] - np.round(UNSEEN_SHADE * original[:, :70])).max() <= 1
    red = np.array([127, 0, 0])  # jet at 1
    np.testing.assert_allclose(drawn[10:170, 70:230], np.round(0.5 * original[10:170, 70:230] + 0.5 * red), atol=1)


def test_cli_cam_draws_on_the_picture_as_the_model_got_it(tmp_path):
    file = tmp_path / "wide.png"
    smooth(120, 80).save(file)
    out = tmp_path / "out"
    assert run(["cam", "torchvision:resnet18", str(file), "--out", str(out)]) == 0
    transform = model_info(load_model("torchvision:resnet18")).transform
    expected = overlay(model_view(load_image(file), transform), np.load(out / "wide.npy"))
    assert np.array_equal(np.asarray(Image.open(out / "wide.png")), np.asarray(expected))


def test_public_names():
    assert layertap.overlay is overlay
    assert view_box(ImageTransform((3, 32, 32)), (32, 32)).size == (32, 32)
