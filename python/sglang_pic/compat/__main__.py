"""``python -m sglang_pic.compat``: the seam table as Markdown.

``--markdown`` prints the seam section of docs/architecture.md; ``--update FILE`` writes it into
``FILE`` between the ``<!-- seams:begin -->`` and ``<!-- seams:end -->`` lines (the test of the
table fails while the committed doc differs from it). ``--static WHEEL_OR_FOLDER`` lists the rows
an SGLang release (a wheel, or a folder holding ``sglang/``) lacks the symbol of, by feature,
without installing it (``compat.static``); with ``--against OLD`` (the release the table was
written for) also the hooked functions whose parameters changed. It exits 1 when there is any.
Reading the table imports no SGLang.
"""

from __future__ import annotations

import argparse
import sys
import zipfile
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
    group.add_argument("--static", metavar="WHEEL_OR_FOLDER", type=Path,
                       help="list the rows an SGLang release lacks the symbol of")
    parser.add_argument("--against", metavar="WHEEL_OR_FOLDER", type=Path,
                        help="with --static: also the rows whose function's parameters differ "
                             "from this release's (the one the table was written for)")
    args = parser.parse_args(argv)
    if args.against and not args.static:
        parser.error("--against goes with --static")
    if args.static:
        return _static(args.static, args.against, parser)
    if args.markdown:
        sys.stdout.write(markdown())
        return 0
    args.update.write_text(updated(args.update.read_text()))
    return 0


def _static(path: Path, against: Path | None, parser: argparse.ArgumentParser) -> int:
    from . import rows_for
    from .static import SourceTree, report

    try:
        tree = SourceTree(path)
        old = SourceTree(against) if against else None
    except (ValueError, OSError, zipfile.BadZipFile) as e:
        parser.error(f"{type(e).__name__}: {e}" if not isinstance(e, ValueError) else str(e))
    seams = rows_for(tree.version)  # the rows written for that release (all: version unknown)
    rows = report(tree, seams, old)
    checked = sum(s.target.startswith("sglang.") for s in seams)
    print(f"SGLang {tree.version or '(version unknown)'} ({path.name}): {len(rows)} of the "
          f"{checked} rows on SGLang cannot apply"
          + (f" or take other parameters than in {old.version or old.path.name}" if old else ""))
    for feature in dict.fromkeys(s.feature for s, _ in rows):
        print(f"\n{feature}:")
        for seam, problem in rows:
            if seam.feature == feature:
                print(f"  {seam.kind:<14} {seam.label}\n  {'':<14} {problem}")
    return 1 if rows else 0


if __name__ == "__main__":
    sys.exit(main())
