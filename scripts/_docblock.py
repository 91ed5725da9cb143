"""Rewrite one generated block of a Markdown file in place (shared by the report scripts).

A block sits between two HTML comments (``<!-- name:begin -->`` ... ``<!-- name:end -->``); the text
around it is the author's and is kept. Plots are copied under ``figures/`` beside the file.
"""

from __future__ import annotations

import shutil
from pathlib import Path


def write_block(doc: Path, begin: str, end: str, body: str, figs: list[Path], prefix: str, title: str) -> None:
    """Replace the ``begin``..``end`` block of ``doc`` with ``body`` and links to ``figs`` (copied to
    ``figures/<prefix><name>``). A missing file is created with ``title``; a missing block is appended."""
    links = []
    if figs:
        (doc.parent / "figures").mkdir(parents=True, exist_ok=True)
    for f in figs:
        dst = doc.parent / "figures" / f"{prefix}{f.name}"
        shutil.copyfile(f, dst)
        links.append(f"![{f.stem}](figures/{dst.name})")
    block = "\n".join([begin, body, "", *links, end])
    text = doc.read_text() if doc.exists() else f"# {title}\n\n{begin}\n{end}\n"
    if begin not in text or end not in text:
        text += f"\n{begin}\n{end}\n"
    pre, rest = text.split(begin, 1)
    doc.write_text(pre + block + rest.split(end, 1)[1])
