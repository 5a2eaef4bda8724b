"""``python -m sglang_pic.compat``: the seam table as Markdown.

``--markdown`` prints the seam section of docs/architecture.md; ``--update FILE`` writes it into
``FILE`` between the ``<!-- seams:begin -->`` and ``<!-- seams:end -->`` lines (the test of the
table fails while the committed doc differs from it). Reading the table imports no SGLang.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import markdown

BEGIN = "<!-- seams:begin -->"
END = "<!-- seams:end -->"


def section(text: str) -> str:
    """What ``text`` holds between the seam markers (ValueError when it has no such pair)."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"no {BEGIN} ... {END} section")
    return text[start + len(BEGIN):end].strip("\n") + "\n"


def updated(text: str) -> str:
    """``text`` with its seam section replaced by the table's."""
    section(text)  # both markers are there
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{markdown()}{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sglang_pic.compat", description=__doc__)
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--markdown", action="store_true", help="print the seam section")
    group.add_argument("--update", metavar="FILE", type=Path,
                       help="write the seam section into FILE between its markers")
    args = parser.parse_args(argv)
    if args.markdown:
        sys.stdout.write(markdown())
        return 0
    args.update.write_text(updated(args.update.read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
