"""What a page handler returns, and the errors that become pages of their own."""

from __future__ import annotations

from dataclasses import dataclass

from .html import Markup


@dataclass(frozen=True)
class Page:
    """A page's title, content and status; the app puts it in the document frame."""

    title: str
    body: Markup
    status: int = 200


class Refused(Exception):
    """A request the dashboard answers with ``status`` and this message (a 400 for bad
    input, 404 for what is not there, 409 when nothing was changed)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status
