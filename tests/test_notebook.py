"""examples/tour.ipynb runs top to bottom in a Jupyter kernel, and its views show their results."""

from pathlib import Path

import pytest

nbclient = pytest.importorskip("nbclient", reason="running the notebook needs nbclient: pip install nbclient nbformat ipykernel")
import nbformat  # (installed with nbclient)

from layertap.shapes import CLASSES, generate

TOUR = Path(__file__).resolve().parent.parent / "examples" / "tour.ipynb"


def text_of(cell) -> str:
    """Everything a code cell showed: streams, HTML and plain-text results."""
    parts = []
    for output in cell.outputs:
        parts.append(output.get("text", ""))
        parts += [str(output.get("data", {}).get(kind, "")) for kind in ("text/html", "text/plain")]
    return "\n".join(parts)


def test_the_tour_notebook_runs_and_shows_its_views(tmp_path):
    notebook = nbformat.read(TOUR, as_version=4)
    # the kernel is this interpreter's (ipykernel's own spec), so it imports this layertap
    nbclient.NotebookClient(notebook, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert not [o for cell in code for o in cell.outputs if o.output_type == "error"]
    _, summary, taps, stats, gradcam, store = (text_of(cell) for cell in code)
    assert "<table>" in summary and "features.block4" in summary and "parameters" in summary
    assert "layertap.Tap" in taps and "[8, 6]" in taps  # the classifier's logits for 8 images
    assert summary.count("<tr") > 5 and stats.count("<svg") == 5  # a sparkline per layer
    names = [CLASSES[int(i)] for i in generate(64, seed=0).labels[:8]]  # the notebook's captions
    assert gradcam.count("<img") == 8 and all(f">{name}</figcaption>" in gradcam for name in names)
    assert "64 (complete; 64 rows hold features)" in store
    assert "extract" in store and "64/64" in store  # the bar shows in a notebook, whose stderr is no terminal
