"""The report's sections: each a function of the `Context` that returns its HTML body, or raises
`Unavailable` saying what it needs."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from .. import cam
from ..data import ImageFiles
from ..images import load_image, to_original
from ..modelinfo import model_info
from ..overlay import overlay
from ..runtime import place_model
from ..select import named_layers
from ..stats import LayerStats, StatsTable
from ..stats import stats as activation_stats
from ..tables import Html, Table
from ..tensorstats import tensor_stats
from ..units import human_bytes
from .context import Context, Unavailable, blocks, left_out, spread, vectors
from .probe import linear_probe
from .projection import PROJECTIONS, available, nearest_mean, project, scatter
from .render import colour_bar, data_uri, esc, histogram, label, legend, num, percent, plain_list

HISTOGRAM_BINS = 24
TILE = 160  # pixels on the long side of a heatmap tile's images, at most
PROBE_FOLDS = 5


# ------------------------------------------------------------------------------ the store
def store_section(ctx: Context) -> str:
    meta, store = ctx.meta, ctx.store
    arrays = "<br>".join(
        f"<code>{esc(a['key'])}</code> {esc(' × '.join(map(str, a['shape'])) or 'scalar')} {esc(a['dtype'])} per sample" for a in meta["arrays"]
    )
    if len(meta["arrays"]) > 30:  # a long list stays folded
        arrays = f"<details><summary>{len(meta['arrays']):,} arrays</summary>{arrays}</details>"
    state = "complete" if store.complete else "<b class='bad'>incomplete</b>: the extraction was interrupted; run it again to finish"
    failed = len(store.failed)
    rows = [
        ("Store", f"<code>{esc(store.path)}</code> ({esc(store.format)}, {state})"),
        ("Model", esc(meta.get("model", "?"))),
        ("Data", _data_line(str(meta.get("data", "?")))),
        ("Samples", f"{store.num_samples:,}" + (f", of which {failed:,} could not be read" if failed else "")),
        ("Labels", _labels_line(ctx)),
        ("Stored arrays", arrays),
        ("Reduction", esc(meta.get("reduce") or "none (whole outputs)")),
        ("Created", esc(meta.get("created", "?")) + " with " + esc(", ".join(f"{k} {v}" for k, v in meta.get("versions", {}).items()))),
    ]
    if ctx.model_note:
        rows.append(("Note", esc(ctx.model_note)))
    body = "".join(f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in rows)
    return f"<table class='facts'>{body}</table>"


def _data_line(data: str) -> str:
    """What the samples were, from `extract_dataset`'s description ("images DIR", "array FILE")."""
    for prefix, what in (("images ", "the image folder"), ("array ", "the array file")):
        if data.startswith(prefix):
            return f"{what} <code>{esc(data.removeprefix(prefix))}</code>"
    return esc(data)


def _labels_line(ctx: Context) -> str:
    if ctx.labels is None:
        return "none"
    present = np.unique(ctx.labels[ctx.valid])
    return plain_list([ctx.class_name(int(k)) for k in present])


# ------------------------------------------------------------------------------ the model's layers
def layers_section(ctx: Context) -> str:
    table = ctx.layer_table
    stored = set(ctx.store.layers)
    rows = []
    for row in table:
        name = row.name or "(model)"
        indent = "\u00a0\u00a0" * (name.count(".") + (1 if row.name else 0))
        shown = f"{indent}{esc(name)}"
        rows.append([
            Html(f"<b>{shown}</b>" if row.name in stored else shown),
            row.type,
            _shape(row.input),
            _shape(row.output),
            str(row.calls),
            f"{row.params_total:,}",
            human_bytes(row.bytes_per_sample) if row.calls else "–",
        ])
    columns = ("Layer", "Type", "Input", "Output", "Calls", "Params", "Output per sample")
    table_html = Table(columns, rows, numeric={"Calls", "Params", "Output per sample"}).html()
    if len(rows) > 80:  # a long table stays folded
        table_html = f"<details><summary>Show all {len(rows)} layers</summary>{table_html}</details>"
    note = " These are its layers, but its weights are not those that wrote the store (see the note above)." if ctx.model_note else ""
    caption = (
        f"{esc(table.model)}: {table.params:,} parameters, shapes for an example batch of {table.batch_size}. "
        f"<b>Bold</b> rows are the layers in the store.{note}"
    )
    return f"<p class='caption'>{caption}</p>{table_html}"


def _shape(structure: Any) -> str:
    if structure is None:
        return "–"
    return json.dumps(structure, separators=(", ", ": "))


# ------------------------------------------------------------------------------ heatmaps
def _heatmap_rows(ctx: Context, count: int) -> tuple[np.ndarray, str]:
    """The rows to explain: the store's misclassified samples first (up to half the grid, from
    its stored output), the rest spread over the store; and a sentence saying so."""
    verdicts = {r: ctx.is_wrong(r, p) for r, p in ctx.predictions.items()}
    wrong = np.array(sorted(r for r, w in verdicts.items() if w), dtype=np.int64)
    picked = spread(wrong, count // 2)
    rows = np.sort(np.concatenate([picked, spread(np.setdiff1d(ctx.valid, picked), count - len(picked))]))
    judged = sum(w is not None for w in verdicts.values())
    if not judged:  # no stored output, or classes that are not the model's: nothing to say
        return rows, ""
    source = f"the store's own output (<code>{esc(ctx.output_key)}</code>)"
    if not len(wrong):
        found = f"None of the {judged:,} sampled images is misclassified by {source}"
    else:
        shown = "them" if len(picked) == len(wrong) else f"{len(picked)} of them"
        found = f"{len(wrong)} of the {judged:,} sampled images are misclassified by {source}; the grid shows {shown}"
    return rows, f" {found}."


def heatmaps_section(ctx: Context, method: str, count: int, layer: str | None) -> str:
    model = ctx.matching_model()
    info = model_info(model)
    if info.kind != "vision":
        raise Unavailable(f"heatmaps need an image model; this one is a {info.kind} model")
    rows, found = _heatmap_rows(ctx, count)
    paths = ctx.image_paths(rows)
    transform = info.transform
    assert transform is not None  # ModelInfo.__post_init__ fills in the default
    pictures = [load_image(p) for p in paths]
    x = torch.stack([transform(p) for p in pictures])
    explainer = cam.METHODS[method](model, layer)
    maps = explainer(x.to(place_model(model, None))).cpu()
    assert explainer.logits is not None  # set by the call above
    probs = explainer.logits.detach().float().softmax(-1).cpu()
    tiles, verdicts = [], []
    for k, row in enumerate(rows.tolist()):
        cls = int(probs[k].argmax())
        wrong = ctx.is_wrong(row, cls)
        verdicts.append(wrong)
        raw = pictures[k].copy()
        raw.thumbnail((TILE, TILE))
        # laid on the whole image, where the model saw it: its resize and crop undone
        heat = overlay(raw, to_original(maps[k], pictures[k], transform, size=raw.size))
        true = ctx.true_name(row)
        image_id = esc(ctx.ids[row])
        frame = {None: "", True: " wrong", False: " ok"}[wrong]
        tiles.append((wrong is not True, k, (  # sorted: the wrong ones first, then in the store's order
            f"<figure class='tile{frame}' data-id='{image_id}'><div class='pair'>"
            f"<img src='{data_uri(raw, photo=True)}' alt='{image_id}' title='{image_id}'>"
            f"<img src='{data_uri(heat)}' alt='heatmap of {image_id}'></div>"
            f"<figcaption><span class='id'>{image_id}</span>"
            + (f"true: <b>{label(true)}</b><br>" if true is not None else "")
            + f"predicted: <b>{label(ctx.predicted_name(cls))}</b> ({100 * float(probs[k, cls]):.0f}%)</figcaption></figure>"
        )))
    judged = [w for w in verdicts if w is not None]
    mistakes = sum(judged)
    if not judged:
        score = ""
    elif not mistakes:
        score = f" All {len(judged)} predictions shown are right (green frames)."
    else:
        score = f" {len(judged) - mistakes} of the {len(judged)} predictions shown are right (green frames); the {mistakes} wrong (red) come first."
    caption = (
        f"{esc(type(explainer).__name__)} at <code>{esc(', '.join(explainer.layers or []))}</code> for the predicted class of "
        f"{len(rows)} images, each shown whole beside its heatmap. The map is laid where the model saw the image (its resize and "
        f"crop undone), at the image's own resolution; what the model did not see is dimmed. Red is where the evidence for "
        f"the class lies; each map is scaled to its own maximum.{score}{found}"
    )
    tiles.sort(key=lambda t: t[:2])
    return f"<p class='caption'>{caption}</p>{colour_bar('none', 'strongest')}<div class='tiles'>{''.join(t[2] for t in tiles)}</div>"


# ------------------------------------------------------------------------------ features in 2-D
def projection_section(ctx: Context, projections: Sequence[str], tips: list[str], hover_note: str) -> str:
    rows = ctx.points
    if len(rows) < 3:
        raise Unavailable(f"a projection needs at least 3 readable samples; the store has {len(rows)}")
    labels = ctx.labels[rows] if ctx.labels is not None else None
    plots: dict[str, list[str]] = {name: [] for name in projections if available(name)}
    for key in ctx.shown:  # one layer's features in memory at a time
        x, width, note = vectors(ctx.store[key], rows)
        finite = np.isfinite(x).all(1)
        for name, drawn in plots.items():
            if finite.sum() < 3:
                drawn.append(f"<p class='missing'>{esc(key)}: fewer than 3 samples without NaN or Inf, nothing to project.</p>")
                continue
            coords, axes = project(name, x[finite])
            lab = labels[finite] if labels is not None else None
            subtitle = f"{width:,} features" + (f" ({note})" if note else "")
            if not finite.all():
                subtitle += f"; {int((~finite).sum())} with NaN/Inf left out"
            if lab is not None and len(np.unique(lab)) > 1:
                subtitle += f"; nearest class mean: {100 * nearest_mean(coords, lab):.0f}% right"
            drawn.append(scatter(coords, np.flatnonzero(finite), lab, tips, axes, key, subtitle))
    parts = []
    for name in projections:
        title = PROJECTIONS[name][0]
        if name not in plots:
            parts.append(f"<p class='missing'>{title} is not drawn: it needs <code>{PROJECTIONS[name][1]}</code> installed.</p>")
            continue
        heading = f"<h3>{title}</h3>" if len(projections) > 1 else ""
        parts.append(f"{heading}<div class='plots'>{''.join(plots[name])}</div>")
    sample = f"{len(rows):,} samples" + (
        f" (evenly spread over the {len(ctx.valid):,} in the store; pass max_points= / --max-points N to draw more)"
        if len(rows) < len(ctx.valid) else ""
    )
    names = " and ".join(PROJECTIONS[n][0] for n in projections)
    caption = (
        f"Each stored layer's features for {sample}, in 2-D by {names}. Classes that form separate clouds are told apart "
        "by that layer; they usually separate more deeply in the network. <i>Nearest class mean</i> is the share of points "
        "lying nearer to the centre of their own class than to any other in the plane. "
        "<span class='js-inline'>Hover a point for its image and classes (the same sample is ringed in every plot), click "
        "to pin it, or find a sample by its id.</span><noscript>Hover a point for its id and classes.</noscript>"
        f"{hover_note}{esc(ctx.left_out('Drawn:'))}"
    )
    finder = (
        "<p class='js-only finder'><label>Find a sample id: <input id='lt-find' type='search' placeholder='e.g. circle/00012.png' "
        "autocomplete='off'></label> <span id='lt-found' role='status'></span></p>"
    )
    names_by_label = {int(k): ctx.class_name(int(k)) for k in np.unique(labels)} if labels is not None else {}
    key = legend(names_by_label) if labels is not None else "<p class='legend'>The store has no labels: points are not coloured by class.</p>"
    return f"<p class='caption'>{caption}</p>{finder}{key}{''.join(parts)}"


# ------------------------------------------------------------------------------ linear probes
def probe_section(ctx: Context) -> str:
    if ctx.labels is None:
        raise Unavailable("the store has no labels, and a probe learns to predict them")
    rows = ctx.sample[ctx.labels[ctx.sample] >= 0]
    y = ctx.labels[rows]
    classes = len(np.unique(y))
    if classes < 2 or len(rows) < 2 * PROBE_FOLDS:
        raise Unavailable(f"a probe needs 2 classes or more and {2 * PROBE_FOLDS} labelled samples; the store has {classes} and {len(rows)}")
    chance = float(np.bincount(np.unique(y, return_inverse=True)[1]).max() / len(y))
    results = []  # (accuracy or -1, depth, key, features, fold range, note)
    made = set()
    depths = {key: depth for depth, key in enumerate(ctx.keys, 1)}
    for key in ctx.shown:
        x, width, how = vectors(ctx.store[key], rows)
        made.add(how)
        finite = np.isfinite(x).all(1)
        note = f" ({int((~finite).sum())} with NaN/Inf left out)" if not finite.all() else ""
        if len(np.unique(y[finite])) < 2 or finite.sum() < 2 * PROBE_FOLDS:
            results.append((-1.0, depths[key], key, width, "", "too few samples without NaN/Inf"))
            continue
        probe = linear_probe(x[finite], y[finite], folds=PROBE_FOLDS)
        fold_range = f"{100 * min(probe.fold_accuracy):.0f}–{100 * max(probe.fold_accuracy):.0f}%"
        results.append((probe.accuracy, depths[key], key, width, fold_range, note))
    best = max(r[0] for r in results)
    table_rows = []
    for rank, (accuracy, depth, key, width, folds, note) in enumerate(sorted(results, key=lambda r: (-r[0], r[1])), 1):
        if accuracy < 0:
            table_rows.append([str(rank), key, str(depth), f"{width:,}", "–", "–", note])
            continue
        bar = Html(
            f"<span class='bar'><span style='width:{100 * accuracy:.1f}%'></span><i style='left:{100 * chance:.1f}%'></i></span>"
            + (" <b>best</b>" if accuracy == best else "") + esc(note)
        )
        table_rows.append([str(rank), key, str(depth), f"{width:,}", f"{100 * accuracy:.1f}%", folds, bar])
    columns = ("Rank", "Layer", "Depth", "Features", "Accuracy", "Per fold", "Against chance (the tick)")
    caption = (
        f"How well each stored layer's features tell the {classes} classes apart with a straight cut: the accuracy of a "
        f"multinomial logistic regression (features standardised, L2 penalty as scikit-learn's C=1) predicting the class, "
        f"cross-validated over {PROBE_FOLDS} stratified folds of {len(rows):,} labelled samples (each held out once). "
        f"Layers are ranked by it; <i>depth</i> is the layer's place in the store, shallow to deep. Chance (always the most "
        f"common class) is {100 * chance:.1f}%." + (f" Before probing: {'; '.join(sorted(made - {''}))}." if made - {""} else "")
        + esc(ctx.left_out("Probed:"))
    )
    return f"<p class='caption'>{caption}</p>" + Table(columns, table_rows, numeric={"Rank", "Depth", "Features", "Accuracy", "Per fold"}).html()


# ------------------------------------------------------------------------------ statistics
def stored_stats(ctx: Context) -> StatsTable:
    """The statistics of the stored features (of the sampled rows), as `layertap.stats` reports them."""
    layer_of = {a["key"]: a["layer"] for a in ctx.meta["arrays"]}
    modules = named_layers(ctx.model) if ctx.model is not None else {}
    rows = {}
    for key in ctx.store:
        total = None
        for block in blocks(ctx.store[key], ctx.sample):
            part = tensor_stats(torch.from_numpy(np.ascontiguousarray(block)).float(), HISTOGRAM_BINS)
            if part is not None:
                total = part if total is None else total.merge(part)
        if total is not None:
            layer = layer_of[key]
            kind = type(modules[layer]).__name__ if layer in modules else "–"
            rows[key] = LayerStats.from_summary(total, name=key, layer=layer, call=0, module_type=kind)
    return StatsTable(rows, missing=[], explode_threshold=1e4)


def stats_section(ctx: Context, table: StatsTable | None, progress: bool) -> str:
    source = "of the layers' whole outputs, computed by <code>layertap.stats</code>"
    if table is None:
        try:
            model = ctx.matching_model()
            paths = ctx.image_paths(ctx.sample)
            table = activation_stats(
                model, ImageFiles(paths, None, model_info(model).transform), ctx.store.layers,
                histogram_bins=HISTOGRAM_BINS, num_workers=0, progress=progress,
            )
            source = f"of each stored layer's whole output, computed by <code>layertap.stats</code> over {len(paths):,} of the store's images"
        except Unavailable as e:
            table = stored_stats(ctx)
            source = f"of the stored features themselves, over {len(ctx.sample):,} samples, not of the layers' whole outputs: {esc(e)}"
    flags = {key: table.flags(r) for key, r in table.items()}
    flagged = any(flags.values())
    layer_of = {a["key"]: a["layer"] for a in ctx.meta["arrays"]}
    shown = set(ctx.shown) | {layer_of[k] for k in ctx.shown}
    listed = [key for key in table if key in shown or key.split("#")[0] in shown or flags[key]]
    rows = []
    for key in listed:
        r = table[key]
        per_sample = r.shape[1:]
        samples = r.count // max(1, int(np.prod(per_sample, dtype=np.int64)))
        dead = f"{len(r.dead_channels)} / {r.channels}" if r.channels is not None else "?"
        row = [
            key, r.module_type, f"{samples:,}", " × ".join(map(str, per_sample)) or "scalar",
            *(num(v) for v in (r.mean, r.std, r.min, r.max)),
            percent(r.zero_fraction), percent(r.nonfinite_fraction), dead,
            Html(histogram(*r.histogram)) if r.histogram is not None else "–",
        ]
        rows.append([*row, ", ".join(f.lower() for f in flags[key])] if flagged else row)
    columns = ["Layer", "Type", "Samples", "Shape per sample", "Mean", "Std", "Min", "Max", "Zeros", "Non-finite", "Dead channels", "Histogram"]
    numeric = {"Samples", "Mean", "Std", "Min", "Max", "Zeros", "Non-finite", "Dead channels"}
    verdict = (
        "Flagged rows (non-finite values, magnitudes above 10<sup>4</sup>, dead channels) are shaded and say why."
        if flagged else "No layer is flagged: no non-finite values, no magnitude above 10<sup>4</sup>, no dead channel."
    )
    caption = (
        f"Statistics {source}. Mean, std, min and max are over finite values; <i>zeros</i> is the share of exact zeros "
        "(ReLU outputs are often half zero); a <i>dead</i> channel is zero for every sample. Histogram bars are log-scaled "
        f"counts; hover a bar for its range and count. {verdict}"
        + esc(left_out("Listed:", listed, list(table), "evenly spread from the first to the last, and every flagged one"))
    )
    indices = {i for i, key in enumerate(listed) if flags[key]}
    return f"<p class='caption'>{caption}</p>" + Table([*columns, "Flags"] if flagged else columns, rows, numeric=numeric, flagged=indices).html()
