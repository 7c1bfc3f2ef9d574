"""A dependency-free progress bar on stderr (drawn only on a terminal)."""

from __future__ import annotations

import sys
import time


class Progress:
    """``Progress(total, label)``; call it with the number done; ``close()`` ends the line."""

    def __init__(self, total: int, label: str, stream=None, enabled=None) -> None:
        self.total = max(total, 1)
        self.label = label
        self.stream = sys.stderr if stream is None else stream
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.start = time.perf_counter()

    def __call__(self, done: int) -> None:
        if not self.enabled:
            return
        width = 30
        filled = int(width * done / self.total)
        elapsed = time.perf_counter() - self.start
        self.stream.write(
            f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] {done}/{self.total} {elapsed:5.1f}s"
        )
        self.stream.flush()

    def close(self) -> None:
        """End the progress line so that what is printed next starts on a line of its own."""
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()
