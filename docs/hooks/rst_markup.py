"""griffe extension: read idembus's reStructuredText docstrings as Markdown.

The docstrings use reST inline markup (````code````, ``:class:`~idembus.x.Name```) and
``::`` literal blocks; mkdocstrings renders docstrings as Markdown. This turns the inline
markup into Markdown code spans and the literal blocks into fenced code, without touching
the source.
"""

from __future__ import annotations

import re
from typing import Any

from griffe import Extension

_ROLE = re.compile(r":(?:class|func|meth|mod|data|attr|exc|obj):`~?([^`]+)`")
_DOUBLE = re.compile(r"``([^`]+)``")


def markdown(text: str) -> str:
    """``text`` (reST inline markup, ``::`` blocks) as Markdown."""
    text = _ROLE.sub(lambda match: f"`{match.group(1)}`", text)
    text = _DOUBLE.sub(lambda match: f"`{match.group(1)}`", text)
    lines = text.split("\n")
    out: list[str] = []
    index = 0
    while index < len(lines):
        line = lines[index]
        if line.rstrip().endswith("::") and not line.strip().startswith(".."):
            stripped = line.rstrip()[:-2].rstrip()
            out.append(stripped + (":" if stripped else ""))
            index += 1
            block: list[str] = []
            while index < len(lines) and (not lines[index].strip()
                                          or lines[index].startswith((" ", "\t"))):
                block.append(lines[index])
                index += 1
            while block and not block[-1].strip():
                block.pop()
            body = [entry for entry in block if entry.strip()]
            indent = min((len(entry) - len(entry.lstrip()) for entry in body), default=0)
            out += ["", "```python"] + [entry[indent:] for entry in block
                                        if entry.strip() or block.index(entry)] + ["```", ""]
            continue
        out.append(line)
        index += 1
    return "\n".join(out)


class RstMarkup(Extension):
    """Rewrite every docstring griffe loads from reST inline markup to Markdown."""

    def on_instance(self, *, obj: Any, **kwargs: Any) -> None:
        """Called for each module, class, function and attribute griffe loads."""
        if obj.docstring is not None:
            obj.docstring.value = markdown(obj.docstring.value)
