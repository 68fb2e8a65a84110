"""Griffe extension for the docs: render the package's reST (Sphinx-style) docstrings in Markdown.

The docstrings follow NumPyro's conventions (``:param x:`` fields, ``:class:`~pkg.Name``` roles and
a ``**Example:**`` section with a ``.. doctest::`` block, last). Griffe's Sphinx parser would fold
everything after the first field into that field, and shows directives and roles verbatim, so before
parsing this extension

* moves the ``**Example:**`` section in front of the fields, as an ``!!! example`` admonition whose
  ``.. doctest::`` / ``.. code-block::`` body becomes a fenced ``python`` block;
* turns roles into code spans, linked (mkdocs-autorefs) when they name a public ``numpyro_pvi``
  object that the API pages render.
"""

from __future__ import annotations

import re
import textwrap
from typing import Any

import griffe

import numpyro_pvi

FIELD = re.compile(
    r"^:(param|parameter|arg|type|return|returns|rtype|raises|raise|ivar|var|cvar|vartype)\b"
)
ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|obj|exc):`(~?)([^`<]+?)(?:\s*<([^>]+)>)?`")
DIRECTIVE = re.compile(r"^\.\. (doctest|code-block|code)::.*$")
#: modules whose public names are rendered on the API pages (so their anchors exist)
RENDERED_MODULES = ("numpyro_pvi.results.plot.", "numpyro_pvi.results.arviz.")


def _target(name: str) -> str | None:
    """The autorefs identifier of a role's target, or None if the docs do not render it."""
    full = name if name.startswith("numpyro_pvi.") else f"numpyro_pvi.{name}"
    parts = full.split(".")
    if len(parts) >= 2 and parts[1] in numpyro_pvi.__all__:
        return full
    if full.startswith(RENDERED_MODULES) and len(parts) == 3:
        return full
    return None


def _role(match: re.Match) -> str:
    tilde, text, explicit = match.group(1), match.group(2).strip(), match.group(3)
    target = (explicit or text).strip()
    shown = text if explicit else (target.rsplit(".", 1)[-1] if tilde else target)
    ref = _target(target)
    return f"[`{shown}`][{ref}]" if ref else f"`{shown}`"


def _example_block(lines: list[str]) -> list[str]:
    """The lines of an ``**Example:**`` section as an admonition with fenced code."""
    head = lines[0].strip()[len("**Example:**") :].strip()
    body: list[str] = []
    i = 1
    if head:
        body.append(head)
    while i < len(lines):
        if DIRECTIVE.match(lines[i].strip()):
            j = i + 1
            while j < len(lines) and (not lines[j].strip() or lines[j].startswith((" ", "\t"))):
                j += 1
            code = textwrap.dedent("\n".join(lines[i + 1 : j])).strip("\n")
            body += ["```python", *code.splitlines(), "```"]
            i = j
        else:
            body.append(lines[i])
            i += 1
    while body and not body[-1].strip():
        body.pop()
    return (
        ['!!! example "Example"', ""]
        + [("    " + line) if line.strip() else "" for line in body]
        + [""]
    )


MULTI_PARAM = re.compile(r"^:param ([\w*]+(?:\s*,\s*[\w*]+)+):(.*)$")


def _split_params(lines: list[str]) -> list[str]:
    """``:param a, b: text`` documents each name: ``:param a: text`` and ``:param b: text``."""
    out = []
    for line in lines:
        match = MULTI_PARAM.match(line)
        if match:
            out += [f":param {name.strip()}:{match.group(2)}" for name in match.group(1).split(",")]
        else:
            out.append(line)
    return out


def rewrite(text: str) -> str:
    """The docstring ``text`` with its example moved before the fields and its roles made
    Markdown."""
    lines = _split_params(text.splitlines())
    start = next(
        (i for i, line in enumerate(lines) if line.strip().startswith("**Example:**")), None
    )
    example: list[str] = []
    if start is not None:
        end = next((i for i in range(start + 1, len(lines)) if FIELD.match(lines[i])), len(lines))
        example, lines = _example_block(lines[start:end]), lines[:start] + lines[end:]
        first_field = next((i for i, line in enumerate(lines) if FIELD.match(line)), len(lines))
        while first_field > 0 and not lines[first_field - 1].strip():
            first_field -= 1
        lines = lines[:first_field] + [""] + example + lines[first_field:]
    return ROLE.sub(_role, "\n".join(lines))


class RstDocstrings(griffe.Extension):
    """Rewrite every docstring of the package before Griffe parses it."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None and obj.path.startswith("numpyro_pvi"):
            obj.docstring.value = rewrite(obj.docstring.value)
