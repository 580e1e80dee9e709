"""Every result file a doc cites is committed: a figure whose file was renamed,
moved or never added cannot be checked by anyone, so README.md and docs/*.md
must not point into docs/results/ at something that is not there.

A citation is a markdown link whose target resolves into docs/results/ (relative
to the doc, as a renderer resolves it), or a bare path in the text, a code span
or a command: `docs/results/...` (from the repository root) or `results/...`
(from the doc's directory, as docs/ writes them). Brace lists
(`docs/results/x/{a,b}`) are expanded and globs must match something; `<name>`
placeholders end the path before them.
"""

from __future__ import annotations

import glob
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"

# [text](target) and [text](target "title"); the target without its #anchor.
_LINK = re.compile(r"\]\(\s*<?([^)\s>#]+)")
# A path into the results: a run of path characters and brace lists, not preceded
# by a path character (so `tests/results/` is not read as `results/`).
_PATH = re.compile(r"(?<![\w./-])(?:docs/)?results/(?:[\w.*/-]|\{[\w.,/-]*\})*")


def _expand(path: str) -> list[str]:
    """`a/{b,c}/d` -> `a/b/d`, `a/c/d` (one brace list after another)."""
    match = re.search(r"\{([^{}]*)\}", path)
    if match is None:
        return [path]
    head, tail = path[: match.start()], path[match.end() :]
    return [p for choice in match.group(1).split(",") for p in _expand(head + choice + tail)]


def _within_results(path: Path) -> bool:
    return path == RESULTS or RESULTS in path.parents


def citations(doc: Path, text: str) -> Iterator[tuple[int, str, Path]]:
    """(line number, the path as written, where it resolves) of each citation of
    a results path in `text`, the contents of `doc`."""
    for number, line in enumerate(text.splitlines(), start=1):
        seen: set[Path] = set()
        found: list[tuple[str, Path]] = []
        for target in _LINK.findall(line):
            if "://" in target or target.startswith("mailto:"):
                continue
            found.append((target, (doc.parent / target).resolve()))
        for written in _PATH.findall(line):
            # Sentence punctuation is not part of the path.
            written = written.rstrip(".,;:")
            base = ROOT if written.startswith("docs/") else doc.parent
            found.extend((p, (base / p).resolve()) for p in _expand(written))
        for written, resolved in found:
            if _within_results(resolved) and resolved not in seen:
                seen.add(resolved)
                yield number, written, resolved


def missing(doc: Path, text: str) -> list[str]:
    """One line per cited results path in `text`, the contents of `doc`, that does
    not exist, naming the doc, the line and the path."""
    problems = []
    for number, written, resolved in citations(doc, text):
        exists = bool(glob.glob(str(resolved))) if "*" in written else resolved.exists()
        if not exists:
            shown = resolved.relative_to(ROOT)
            problems.append(f"{doc.relative_to(ROOT)}:{number}: cites {written} ({shown}): missing")
    return problems


def _docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_every_cited_result_file_exists() -> None:
    problems = [p for doc in _docs() for p in missing(doc, doc.read_text(encoding="utf-8"))]
    assert not problems, "docs cite result files that are not committed:\n" + "\n".join(problems)


def test_the_docs_do_cite_result_files() -> None:
    # The scan must find what is there: a pattern that matched nothing would pass
    # the test above for every doc.
    cited = [c for doc in _docs() for c in citations(doc, doc.read_text(encoding="utf-8"))]
    assert len(cited) >= 10


def test_a_missing_citation_names_the_doc_line_and_path() -> None:
    doc = ROOT / "docs" / "example.md"  # read from `text`, never written
    text = (
        "Fine: [report](results/soak-60min/report.md), `docs/results/pick/run-1.json`.\n"
        "Gone: [report](results/no-such-run/report.md).\n"
        "python -m bench.profile_study docs/results/default-profile/{shared-prefix,nope}\n"
        "Outside the results: [x](kubernetes.md), https://example.com/results/x.\n"
    )
    found = [(n, w) for n, w, _ in citations(doc, text)]
    assert found == [
        (1, "results/soak-60min/report.md"),
        (1, "docs/results/pick/run-1.json"),
        (2, "results/no-such-run/report.md"),
        (3, "docs/results/default-profile/shared-prefix"),
        (3, "docs/results/default-profile/nope"),
    ]
    assert missing(doc, text) == [
        "docs/example.md:2: cites results/no-such-run/report.md"
        " (docs/results/no-such-run/report.md): missing",
        "docs/example.md:3: cites docs/results/default-profile/nope"
        " (docs/results/default-profile/nope): missing",
    ]
