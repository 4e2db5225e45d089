"""For the docstrings' examples (``--doctest-modules src/layertap``; tests/ has its own conftest).

Each example runs in its own temporary folder: the working directory, and the folder
``tempfile`` hands out (``mkdtemp()``, ``gettempdir()``), are the example's ``tmp_path``. So an
example writes nothing into the source tree or the shared system temp folder, two runs on one
machine never meet (`make isolation` runs two at once), and what it wrote is cleaned up with the
rest of pytest's temporary folders. tests/test_isolation.py checks that no example names a fixed
temporary path of its own.
"""

import tempfile

import pytest
from _pytest.doctest import DoctestItem


@pytest.fixture(autouse=True)
def _example_in_its_own_folder(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if isinstance(request.node, DoctestItem):
        folder = request.getfixturevalue("tmp_path")
        monkeypatch.chdir(folder)
        monkeypatch.setattr(tempfile, "tempdir", str(folder))
