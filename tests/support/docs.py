"""The project's Markdown as tests read it: its fenced code blocks, to run them as written."""

from __future__ import annotations

import re

from tests.support.procs import ROOT

README = ROOT / "README.md"


def code_blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def block_with(text: str, lang: str, marker: str) -> str:
    found = [b for b in code_blocks(text, lang) if marker in b]
    assert len(found) == 1, f"README: one ```{lang} block with {marker!r} expected, found {len(found)}"
    return found[0]
