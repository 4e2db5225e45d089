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
    "--enable-logging=stderr", "--v=0",
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
                [CHROMIUM, *_FLAGS, "--window-size=1280,2000", f"--user-data-dir={profile}", *args, url],
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
    """Not blank, every heading in the DOM (in order), no error from the page itself."""
    assert page.screenshot.shape[:2] == (2000, 1280)
    colours = np.unique(page.screenshot.reshape(-1, 3)[::7], axis=0)
    assert len(colours) > 200, f"the screenshot looks blank: {len(colours)} colours"
    assert page.screenshot.std() > 20
    found = re.findall(r"<h2>(.*?)</h2>", page.dom)
    assert found == headings
    assert not page.page_errors, page.page_errors


class Browser:
    """One headless Chromium driven through the DevTools protocol over a pipe (no extra package).

    Chromium's ``--remote-debugging-pipe`` reads commands on its fd 3 and writes replies and
    events on its fd 4, each a JSON message ending in a NUL byte. A page is opened in its own
    target; `evaluate` runs JavaScript there, `move` and `click` send real mouse events at CSS
    pixel positions of the viewport, and `errors` lists what the page reported: console errors,
    uncaught exceptions, failed loads. ``scripts=False`` turns the page's scripts off
    (``--blink-settings=scriptEnabled=false``; ``--dump-dom`` prints nothing then), while
    `evaluate` still reads the page through DevTools.
    """

    def __init__(self, width: int = 1280, height: int = 900, timeout: float = 30, *, scripts: bool = True) -> None:
        import fcntl
        import os

        self.timeout = timeout
        self._tmp = tempfile.TemporaryDirectory()
        commands, self._to_browser = os.pipe()
        self._from_browser, replies = os.pipe()
        # file actions run in order: sources above 9 cannot be overwritten by an earlier target (3, 4)
        high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10) for fd in (commands, replies)]
        for fd in (commands, replies):
            os.close(fd)
        self._log = open(Path(self._tmp.name) / "chromium.log", "wb")  # noqa: SIM115 (closed in close())
        null = os.open(os.devnull, os.O_RDWR)
        off = [] if scripts else ["--blink-settings=scriptEnabled=false"]  # the page's scripts; DevTools' still run
        args = [CHROMIUM, *_FLAGS, *off, f"--window-size={width},{height}", "--remote-debugging-pipe", f"--user-data-dir={self._tmp.name}/profile", "about:blank"]
        actions = [(os.POSIX_SPAWN_DUP2, null, 0), (os.POSIX_SPAWN_DUP2, null, 1), (os.POSIX_SPAWN_DUP2, self._log.fileno(), 2),
                   (os.POSIX_SPAWN_DUP2, high[0], 3), (os.POSIX_SPAWN_DUP2, high[1], 4)]
        self.pid = os.posix_spawn(CHROMIUM, args, dict(os.environ), file_actions=actions)
        for fd in (*high, null):
            os.close(fd)
        self._buffer = b""
        self._next = 0
        self.events: list[dict] = []
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        self.session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Page", "Runtime", "Log"):
            self.send(f"{domain}.enable", session=True)
        self.send("Emulation.setDeviceMetricsOverride", {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False}, session=True)

    def _read(self) -> dict:
        import json
        import os
        import select
        import time

        deadline = time.monotonic() + self.timeout
        while b"\0" not in self._buffer:
            ready, _, _ = select.select([self._from_browser], [], [], max(0.0, deadline - time.monotonic()))
            chunk = os.read(self._from_browser, 1 << 20) if ready else b""
            if not chunk:
                raise TimeoutError(f"Chromium sent nothing for {self.timeout} s (or exited): {self.log()[-2000:]}")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def send(self, method: str, params: dict | None = None, *, session: bool = False) -> dict:
        """Send one command (to the page's session with ``session``) and return its result."""
        import json
        import os

        self._next += 1
        message = {"id": self._next, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = self.session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        while True:
            reply = self._read()
            if reply.get("id") == self._next:
                assert "error" not in reply, (method, reply["error"])
                return reply.get("result", {})
            self.events.append(reply)

    def wait_for(self, event: str) -> dict:
        """The first event named ``event`` (already received, or waited for)."""
        while True:
            for i, seen in enumerate(self.events):
                if seen.get("method") == event:
                    return self.events.pop(i)
            self.events.append(self._read())

    def open(self, html_file: Path) -> None:
        self.send("Page.navigate", {"url": Path(html_file).resolve().as_uri()}, session=True)
        self.wait_for("Page.loadEventFired")

    def evaluate(self, expression: str):
        """The value of a JavaScript expression in the page (JSON-able values)."""
        result = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True, "awaitPromise": True}, session=True)
        assert "exceptionDetails" not in result, result["exceptionDetails"]
        return result["result"].get("value")

    def move(self, x: float, y: float) -> None:
        self.send("Input.dispatchMouseEvent", {"type": "mouseMoved", "x": x, "y": y}, session=True)

    def click(self, x: float, y: float) -> None:
        for kind in ("mousePressed", "mouseReleased"):
            self.send("Input.dispatchMouseEvent", {"type": kind, "x": x, "y": y, "button": "left", "clickCount": 1}, session=True)

    def type(self, text: str) -> None:
        self.send("Input.insertText", {"text": text}, session=True)

    def screenshot(self, path: Path) -> None:
        import base64

        Path(path).write_bytes(base64.b64decode(self.send("Page.captureScreenshot", {"format": "png"}, session=True)["data"]))

    def errors(self) -> list[str]:
        """What the page reported as errors so far: console errors and warnings, uncaught exceptions, failed loads."""
        found = []
        for event in self.events:
            method, params = event.get("method"), event.get("params", {})
            if method == "Runtime.exceptionThrown":
                found.append(str(params["exceptionDetails"]))
            elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "warning", "assert"):
                found.append(str(params.get("args")))
            elif method == "Log.entryAdded" and params["entry"].get("level") in ("error", "warning"):
                found.append(str(params["entry"]))
        return found

    def log(self) -> str:
        self._log.flush()
        return (Path(self._tmp.name) / "chromium.log").read_text(errors="replace")

    def close(self) -> None:
        import os
        import signal
        import time

        try:
            self.send("Browser.close")
        except (OSError, TimeoutError, AssertionError):
            os.kill(self.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while os.waitpid(self.pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
                break
            time.sleep(0.05)
        for fd in (self._to_browser, self._from_browser):
            os.close(fd)
        self._log.close()
        self._tmp.cleanup()

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
