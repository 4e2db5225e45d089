"""Render an HTML file in headless Chromium (Debian's ``chromium``, installed by ``.ci/run``)."""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
needs_chromium = pytest.mark.skipif(
    not Path(CHROMIUM).exists(), reason="headless Chromium is not installed (apt-get install chromium; .ci/run does)"
)
_FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--enable-logging=stderr", "--v=0", "--window-size=1280,2000",
)
# what Chromium logs for the page's own errors: console messages, uncaught exceptions, failed loads
_PAGE_ERRORS = re.compile(r"CONSOLE|Uncaught|Failed to load resource|net::ERR_")


@dataclass
class Rendered:
    dom: str  # the DOM after the page loaded
    screenshot: np.ndarray  # [H, W, 3] uint8
    page_errors: list[str]  # Chromium's log lines about the page's errors


def render(html_file: Path) -> Rendered:
    """The page's DOM, a 1280x2000 screenshot and its console errors, from two Chromium runs."""
    from PIL import Image

    url = Path(html_file).resolve().as_uri()
    logs = []
    with tempfile.TemporaryDirectory() as tmp:
        def chromium(*args: str) -> subprocess.CompletedProcess:
            profile = tempfile.mkdtemp(dir=tmp)  # a fresh profile each run
            done = subprocess.run(
                [CHROMIUM, *_FLAGS, f"--user-data-dir={profile}", *args, url],
                capture_output=True, text=True, timeout=120, check=False,
            )
            assert done.returncode == 0, done.stderr[-2000:]
            logs.extend(done.stderr.splitlines())
            return done

        dom = chromium("--dump-dom").stdout
        shot = Path(tmp) / "page.png"
        chromium(f"--screenshot={shot}")
        pixels = np.asarray(Image.open(shot).convert("RGB"))
    return Rendered(dom, pixels, [line for line in logs if _PAGE_ERRORS.search(line)])


def assert_readable(page: Rendered, headings: list[str]) -> None:
    """Not blank, every heading in the DOM, no error from the page itself."""
    assert page.screenshot.shape[:2] == (2000, 1280)
    colours = np.unique(page.screenshot.reshape(-1, 3)[::7], axis=0)
    assert len(colours) > 200, f"the screenshot looks blank: {len(colours)} colours"
    assert page.screenshot.std() > 20
    found = re.findall(r"<h2>(.*?)</h2>", page.dom)
    assert found == headings
    assert not page.page_errors, page.page_errors
