"""mkdocs hooks (mkdocs.yml ``hooks:``): files from the repository root inside pages.

A page line ``{! BENCHMARKS.md !}`` becomes that file's text, its links to ``docs/...``
made relative to the page (the site is built from docs/ alone), its first heading
dropped (the page has its own), and a blank line put before a list that follows a
paragraph directly (GitHub starts the list there; Python-Markdown needs the blank line).
A missing file fails the build.
"""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.exceptions import PluginError

_INCLUDE = re.compile(r"^\{!\s*(?P<name>[\w.-]+)\s*!\}$", re.M)
_DOCS_LINK = re.compile(r"\]\(docs/")
# a list item right under a line of text that is not itself a list item
_LIST_AFTER_TEXT = re.compile(r"^((?!\s*(?:[-*]|\d+\.)\s)\S.*)\n(\s*(?:[-*]|\d+\.)\s)", re.M)
# Sphinx roles in docstrings (:class:`X`) read as plain code on the site.
_ROLE = re.compile(r":(?:class|func|meth|attr|mod|data|exc):(<code>)")


def on_page_markdown(markdown: str, page, config, files) -> str:
    root = Path(config["config_file_path"]).parent

    def include(match: re.Match) -> str:
        path = root / match["name"]
        if not path.is_file():
            raise PluginError(f"{page.file.src_path}: {{! {match['name']} !}}: no such file")
        text = path.read_text(encoding="utf-8")
        text = re.sub(r"\A# .*\n+", "", text)
        text = _LIST_AFTER_TEXT.sub(r"\1\n\n\2", text)
        return _DOCS_LINK.sub("](", text)

    return _INCLUDE.sub(include, markdown)


def on_page_content(html: str, page, config, files) -> str:
    return _ROLE.sub(r"\1", html)
