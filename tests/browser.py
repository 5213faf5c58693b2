"""Headless Chromium for tests, driven over the DevTools protocol on a pipe (no port, no extra package).

``Browser`` starts ``chromium --headless --remote-debugging-pipe`` with the protocol on file descriptors 3
(commands in) and 4 (replies and events out), each message a JSON object ended by a NUL byte. A page is
opened with :meth:`Browser.open`; :meth:`Page.js` evaluates an expression in it and returns its value;
:meth:`Page.screenshot` writes a PNG. A test aid: it speaks just enough of the protocol for that.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

CANDIDATES = ("chromium", "chromium-browser", "google-chrome")


def chromium_path() -> str | None:
    """The Chromium binary on PATH, if any."""
    return next((path for name in CANDIDATES if (path := shutil.which(name))), None)


def _onto_3_and_4(commands: int, replies: int) -> None:
    # Through high numbers first, so that neither copy overwrites the other pipe end.
    high_commands, high_replies = os.dup2(commands, 100), os.dup2(replies, 101)
    os.dup2(high_commands, 3)
    os.dup2(high_replies, 4)


class BrowserError(RuntimeError):
    """The browser answered a command with an error, or went away."""


class Browser:
    """One headless Chromium process (use as a context manager)."""

    def __init__(self, binary: str, *, width: int = 1280, height: int = 900, timeout: float = 30) -> None:
        self.timeout = timeout
        self._profile = tempfile.mkdtemp(prefix="pvh-chromium-")
        commands_r, self._commands = os.pipe()
        self._replies, replies_w = os.pipe()
        # The child's fd 3 reads our commands, fd 4 writes its replies; dup2 in the child puts them there.
        self._process = subprocess.Popen(
            [
                binary,
                "--headless=new",
                "--remote-debugging-pipe",
                "--no-sandbox",
                "--disable-gpu",
                "--no-first-run",
                "--disable-extensions",
                "--allow-file-access-from-files",
                f"--window-size={width},{height}",
                f"--user-data-dir={self._profile}",
                "about:blank",
            ],
            pass_fds=(3, 4),
            preexec_fn=lambda: _onto_3_and_4(commands_r, replies_w),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(commands_r)
        os.close(replies_w)
        self._ids = itertools.count(1)
        self._buffer = b""

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the browser and remove its profile."""
        for fd in (self._commands, self._replies):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._process.kill()
        self._process.wait(timeout=10)
        shutil.rmtree(self._profile, ignore_errors=True)

    def send(self, method: str, params: dict[str, Any] | None = None, session: str | None = None) -> dict[str, Any]:
        """Send one command and wait for its reply (events that come first are dropped)."""
        message_id = next(self._ids)
        message: dict[str, Any] = {"id": message_id, "method": method, "params": params or {}}
        if session is not None:
            message["sessionId"] = session
        os.write(self._commands, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            reply = self._read()
            if reply.get("id") == message_id:
                if "error" in reply:
                    raise BrowserError(f"{method}: {reply['error']}")
                return dict(reply.get("result", {}))
        raise BrowserError(f"{method}: no reply within {self.timeout}s")

    def _read(self) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            chunk = os.read(self._replies, 1 << 16)
            if not chunk:
                raise BrowserError("the browser closed its pipe")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return dict(json.loads(message))

    def open(self, url: str) -> Page:
        """A new tab at ``url``, once its document has loaded."""
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        page = Page(self, session)
        self.send("Page.navigate", {"url": url}, session)
        page.wait_for("document.readyState === 'complete'")
        return page


class Page:
    """One tab."""

    def __init__(self, browser: Browser, session: str) -> None:
        self.browser, self.session = browser, session

    def js(self, expression: str) -> Any:
        """Evaluate ``expression`` in the page and return its value (JSON-serialisable values only)."""
        reply = self.browser.send(
            "Runtime.evaluate", {"expression": expression, "returnByValue": True, "awaitPromise": True}, self.session
        )
        if "exceptionDetails" in reply:
            raise BrowserError(
                f"{expression[:80]}: {reply['exceptionDetails'].get('exception', {}).get('description')}"
            )
        return reply["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 20) -> None:
        """Wait until ``expression`` is truthy in the page."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if self.js(expression):
                    return
            except BrowserError:
                pass  # the document is being replaced
            time.sleep(0.05)
        raise BrowserError(f"still false after {timeout}s: {expression}")

    def screenshot(self, path: Path, *, full_page: bool = False) -> Path:
        """A PNG of the viewport (or the whole page) at ``path``."""
        params: dict[str, Any] = {"format": "png"}
        if full_page:
            params["captureBeyondViewport"] = True
        data = self.browser.send("Page.captureScreenshot", params, self.session)["data"]
        path.write_bytes(base64.b64decode(data))
        return path
