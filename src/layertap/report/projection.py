"""Features in 2-D: each stored layer projected on a plane, one point per sample.

PCA (numpy-free, torch float64) always; t-SNE (scikit-learn) and UMAP (umap-learn) when asked
for and installed. The points are inline SVG circles, so the plots show without scripts; the
page's script adds the thumbnail on hover, pinning and search (see `layertap.report`).
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Callable, Iterator

import numpy as np
import torch

from .render import colour, esc

#: Projections to 2-D by name: (title, what it needs installed, or "").
PROJECTIONS = {"pca": ("PCA", ""), "tsne": ("t-SNE", "sklearn"), "umap": ("UMAP", "umap")}


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Torch on one thread for the block: small solves gain nothing from a second thread, and
    beside another busy process OpenMP's barriers make two threads many times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def pca(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The first two principal components' coordinates ``[N, 2]`` and shares of the variance.

    From the eigenvectors of the smaller of the two Gram matrices (``D x D`` or ``N x N``), in
    float64: exact for the leading components, and fast at any width.
    """
    t = torch.from_numpy(np.asarray(x, dtype=np.float64))
    t = t - t.mean(0)
    with one_thread():
        if t.shape[1] <= t.shape[0]:
            values, vectors = torch.linalg.eigh(t.T @ t)
            coords = t @ vectors[:, -2:].flip(1)
        else:
            values, vectors = torch.linalg.eigh(t @ t.T)
            coords = vectors[:, -2:].flip(1) * values[-2:].flip(0).clamp(min=0).sqrt()
    values = values.flip(0).clamp(min=0)
    total = float(values.sum())
    share = (values[:2] / total if total > 0 else torch.zeros(2)).numpy()
    coords = coords.numpy()
    if coords.shape[1] < 2:  # a single feature: one component
        coords, share = np.pad(coords, ((0, 0), (0, 2 - coords.shape[1]))), np.pad(share, (0, 2 - len(share)))
    return coords, share


def _tsne(x: np.ndarray) -> np.ndarray:
    from sklearn.manifold import TSNE

    return TSNE(2, perplexity=min(30.0, (len(x) - 1) / 3), init="pca", random_state=0).fit_transform(x)


def _umap(x: np.ndarray) -> np.ndarray:
    import umap

    return umap.UMAP(n_neighbors=min(15, len(x) - 1), random_state=0).fit_transform(x)


def available(name: str) -> bool:
    needs = PROJECTIONS[name][1]
    return not needs or importlib.util.find_spec(needs) is not None


def project(name: str, x: np.ndarray) -> tuple[np.ndarray, tuple[str, str]]:
    """``x`` in 2-D by projection ``name``, and the two axes' labels."""
    if name == "pca":
        coords, share = pca(x)
        return coords, (f"PC1 ({100 * share[0]:.0f}% of variance)", f"PC2 ({100 * share[1]:.0f}% of variance)")
    method: Callable[[np.ndarray], np.ndarray] = {"tsne": _tsne, "umap": _umap}[name]
    standardised = (x - x.mean(0)) / np.where(x.std(0) > 0, x.std(0), 1.0)
    with one_thread():
        coords = method(standardised.astype(np.float32))
    title = PROJECTIONS[name][0]
    return np.asarray(coords, dtype=np.float64), (f"{title} 1", f"{title} 2")


def nearest_mean(coords: np.ndarray, labels: np.ndarray) -> float:
    """Share of points nearer to their own class's mean than to any other (in the plane)."""
    classes = np.unique(labels)
    means = np.stack([coords[labels == k].mean(0) for k in classes])
    nearest = classes[((coords[:, None, :] - means[None]) ** 2).sum(-1).argmin(1)]
    return float((nearest == labels).mean())


def scatter(
    coords: np.ndarray, points: np.ndarray, labels: np.ndarray | None, tips: list[str], axes: tuple[str, str], title: str, subtitle: str
) -> str:
    """One plot: a circle per point, ``data-i`` its index in the page's samples, ``tips`` its
    ``<title>`` (shown on hover without scripts)."""
    width, height, left, right, top, bottom = 380, 330, 34, 12, 46, 40
    w, h = width - left - right, height - top - bottom
    lo, hi = coords.min(0), coords.max(0)
    span = np.where(hi - lo > 0, hi - lo, 1.0)
    px = left + 4 + (coords[:, 0] - lo[0]) / span[0] * (w - 8)
    py = top + 4 + (1 - (coords[:, 1] - lo[1]) / span[1]) * (h - 8)
    order = np.random.default_rng(0).permutation(len(coords))  # no class drawn entirely on top
    dots = "".join(
        f"<circle cx='{px[i]:.1f}' cy='{py[i]:.1f}' r='3' fill='{colour(int(labels[i])) if labels is not None else colour(0)}' "
        f"data-i='{points[i]}'><title>{tips[points[i]]}</title></circle>"
        for i in order
    )
    return (
        f"<svg class='plot' width='{width}' height='{height}' viewBox='0 0 {width} {height}' role='img' aria-label='{esc(title)}'>"
        f"<text x='{width / 2}' y='18' class='t'>{esc(title)}</text>"
        f"<text x='{width / 2}' y='35' class='s'>{esc(subtitle)}</text>"
        f"<rect x='{left}' y='{top}' width='{w}' height='{h}' class='frame'/>"
        f"<g class='dots'>{dots}</g>"
        f"<text x='{left + w / 2}' y='{height - 12}' class='a'>{esc(axes[0])}</text>"
        f"<text x='14' y='{top + h / 2}' class='a' transform='rotate(-90 14 {top + h / 2})'>{esc(axes[1])}</text>"
        "</svg>"
    )


