"""Reading a process's output into a log file, and waiting for lines in it."""

from __future__ import annotations

import pathlib
import threading
from typing import IO


class LogWatch:
    """Reads ``stream`` in a thread until it ends, appending each line to ``path``;
    other threads count lines containing a text or wait for them."""

    def __init__(self, stream: IO[str], path: pathlib.Path) -> None:
        self.path = path
        self._lines: list[str] = []
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._read, args=(stream,),
                                        name=f"logwatch-{path.name}", daemon=True)
        self._thread.start()

    def _read(self, stream: IO[str]) -> None:
        with stream, self.path.open("a", encoding="utf-8") as log:
            for line in stream:
                log.write(line)
                log.flush()
                with self._changed:
                    self._lines.append(line.rstrip("\n"))
                    self._changed.notify_all()

    def count(self, text: str) -> int:
        """How many lines so far contain ``text``."""
        with self._changed:
            return sum(text in line for line in self._lines)

    def wait_for(self, text: str, count: int = 1, timeout: float = 60.0) -> bool:
        """Wait until ``count`` lines contain ``text``; False after ``timeout`` seconds."""
        with self._changed:
            return self._changed.wait_for(
                lambda: sum(text in line for line in self._lines) >= count, timeout)

    def matching(self, text: str) -> list[str]:
        """The lines so far that contain ``text``."""
        with self._changed:
            return [line for line in self._lines if text in line]

    def join(self, timeout: float = 30.0) -> None:
        """Wait until the stream has ended (the process and its children closed it)."""
        self._thread.join(timeout)
