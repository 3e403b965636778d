#!/usr/bin/env python
"""Check that the tables of measured figures in the README and the docs pages say what their result files say.

A table cites its result files by naming them (`benchmarks/results/NAME.json`, brace lists such as
`bench-{native,avx2}.json` and globs allowed, or a bare file name that exists there) in the text between
the heading or table before it and the table, in the table itself, or in the paragraph right after it.
Every number in the body cells of a citing table must then appear in one of those files, at the precision
it is printed with (41 matches 40.6 but not 40.46; 12% matches 0.12; 28k matches 27,640).

Tables that cite files but whose figures cannot all be found there are listed in UNCHECKED with the
reason; the script says which ones it skipped. A table that cites nothing is not a results table and is
not checked. Exit status 1 when a figure is missing or, when the README and every docs page are checked
(the default), an UNCHECKED entry no longer matches a table in any of them.

    python scripts/check_figures.py [FILE.md ...]     # default: README.md and docs/*.md
"""

from __future__ import annotations

import glob
import itertools
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = "benchmarks/results"

# Tables, or rows of them, whose figures the cited files do not hold: the table's header row (exact), or
# (header row, the row's first cell) -> why. The other rows of such a table are still checked.
NOT_KEPT = "from a run whose result file was not kept (the text beside the table says so)"
FEATURE_SPEED = "| machine, prompts | plain | Medusa tree-8 | feature, planned tree | feature, dynamic-16x5 |"
UNCHECKED: dict[str | tuple[str, str], str] = {
    # Decoding speed, batch size 1: bench.json holds the first figure of each cell (and the ratios of
    # those); the second and third are two earlier runs.
    "| | tok/s | vs HF generate |": "the second and third figures of each cell are " + NOT_KEPT,
    # Feature heads, speed at batch size 1: the Xeon rows are checked.
    (FEATURE_SPEED, "AMD EPYC (AVX-512 bf16; auto: bf16), 4 MT-bench prompts"): NOT_KEPT,
    (FEATURE_SPEED, "AMD EPYC, bf16, 6 mixed-task prompts"): NOT_KEPT,
    # Feature heads, tau against training tokens.
    "| data | unique prompts | trained positions | held-out top-1, steps 1 / 2 | tau (dynamic-16x5) |":
        "the held-out top-1 figures and position counts come from each head's eval.json in its training "
        "run (the shipped head's is medusa/assets/feature_heads/eval.json), not from the tau files; the "
        "shipped row's tau is the EPYC run above, " + NOT_KEPT,
}

CITE = re.compile(r"benchmarks/results/([\w.*{},\-]+)")
BARE = re.compile(r"`([\w\-]+\.(?:json|txt|md|\{[\w,]+\}))`")
# A figure: a number not glued to a name (tree-8, dynamic-6x2, K=3 is a setting but harmless), with an
# optional k (thousands), % or x (a ratio) after it.
FIGURE = re.compile(r"(?<![\w.\-])(\d+(?:\.\d+)?)(k|%)?(?![\d.]*\d)(?![A-Za-wyz_\-])")
NUMBER = re.compile(r"(?<![\d.])(?:(?<![\w])-)?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")  # auto-5: 5, not -5


@dataclass
class Table:
    line: int                      # 1-based line of the header row
    header: str
    rows: list[tuple[int, str]]    # (line, text) of the body rows
    cites: list[str] = field(default_factory=list)


def expand(pattern: str) -> list[str]:
    """`a-{x,y}.{json,md}` -> every existing file it names under benchmarks/results (globs allowed)."""
    parts = re.split(r"\{([^{}]*)\}", pattern.rstrip(".,;:)"))
    names = ["".join(p) for p in itertools.product(*[[s] if i % 2 == 0 else s.split(",")
                                                      for i, s in enumerate(parts)])]
    found = []
    for name in names:
        found += sorted(str(Path(p).relative_to(ROOT)) for p in glob.glob(str(ROOT / RESULTS / name)))
    return found


def citations(text: str) -> list[str]:
    found = [f for m in CITE.finditer(text) for f in expand(m.group(1))]
    found += [f for m in BARE.finditer(text) for f in expand(m.group(1))]
    return list(dict.fromkeys(found))


def tables(lines: list[str]) -> list[Table]:
    """Every table with the files cited around it."""
    out, i = [], 0
    context_start = 0  # the text a table's citations are looked for in starts after the last heading/table
    while i < len(lines):
        if lines[i].startswith("#"):
            context_start = i
        if not lines[i].startswith("|"):
            i += 1
            continue
        start = i
        while i < len(lines) and lines[i].startswith("|"):
            i += 1
        after = i  # the paragraph after the table (past blank lines)
        while after < len(lines) and not lines[after].strip():
            after += 1
        while after < len(lines) and lines[after].strip() and not lines[after].startswith(("#", "|", "```")):
            after += 1
        t = Table(start + 1, lines[start], [(n + 1, lines[n]) for n in range(start + 2, i)])
        t.cites = citations("\n".join(lines[context_start:after]))
        out.append(t)
        context_start = after
    return out


def file_numbers(path: Path) -> list[float]:
    """Every number a result file holds: JSON values and keys, and numbers inside its strings and text (a
    picture or other binary file holds none)."""
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        return []
    values: list[float] = []
    if path.suffix == ".json":
        def walk(x):
            if isinstance(x, bool):
                return
            if isinstance(x, (int, float)):
                values.append(float(x))
            elif isinstance(x, str):
                values.extend(float(n) for n in NUMBER.findall(x))
            elif isinstance(x, dict):
                for k, v in x.items():
                    walk(k)
                    walk(v)
            elif isinstance(x, list):
                for v in x:
                    walk(v)
        walk(json.loads(text))
    else:
        values = [float(n) for n in NUMBER.findall(text)]
    return values


def figures(row: str) -> list[tuple[str, float, float]]:
    """(as printed, value, half a unit of its last printed digit) of every figure in the row's cells."""
    cells = row.strip().strip("|").split("|")[1:]  # the first cell names the row
    out = []
    for cell in cells:
        cell = re.sub(r"`[^`]*`", "", cell)  # code (flags, names) is not a figure
        for m in FIGURE.finditer(cell):
            number, suffix = m.group(1), m.group(2) or ""
            decimals = len(number.split(".")[1]) if "." in number else 0
            value, half = float(number), 0.5 * 10 ** -decimals
            if suffix == "k":
                value, half = value * 1000, half * 1000
            elif suffix == "%":
                value, half = value / 100, half / 100
            out.append((number + suffix, value, half))
    return out


def found(value: float, half: float, numbers: list[float]) -> bool:
    eps = 1e-9 + half * 1e-6
    return any(abs(v - value) <= half + eps for v in numbers)


def default_files() -> list[Path]:
    """The README and every docs page."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def shown(path: Path) -> str:
    """A file's name as messages give it: relative to the repository where it lies inside it."""
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return path.name


def check(readme: Path, seen_unchecked: set | None = None,
          cache: dict[str, list[float]] | None = None) -> tuple[list[str], list[str], list[str]]:
    """(problems, lines describing what was checked, lines describing what was not) for one Markdown file.
    The UNCHECKED entries it meets are added to `seen_unchecked`."""
    lines = readme.read_text().splitlines()
    name = shown(readme)
    problems, checked, skipped = [], [], []
    seen_unchecked = set() if seen_unchecked is None else seen_unchecked
    cache = {} if cache is None else cache
    for t in tables(lines):
        if not t.cites:
            count = sum(len(figures(row)) for _, row in t.rows)
            if count:
                skipped.append(f"{name} line {t.line}: cites no result file, {count} figures not checked")
            continue
        if t.header in UNCHECKED:
            seen_unchecked.add(t.header)
            skipped.append(f"{name} line {t.line}: not checked ({UNCHECKED[t.header]}); cites {', '.join(t.cites)}")
            continue
        numbers = [v for f in t.cites for v in cache.setdefault(f, file_numbers(ROOT / f))]
        rows = []
        for n, row in t.rows:
            key = (t.header, row.strip().strip("|").split("|")[0].strip())
            if key in UNCHECKED:
                seen_unchecked.add(key)
                skipped.append(f"{name} line {n}: row not checked ({UNCHECKED[key]})")
            else:
                rows.append((n, row))
        missing = [(n, printed) for n, row in rows for printed, value, half in figures(row)
                   if not found(value, half, numbers)]
        count = sum(len(figures(row)) for _, row in rows)
        checked.append(f"{name} line {t.line}: {count} figures against {', '.join(t.cites)}")
        for n, printed in missing:
            problems.append(f"{name}:{n}: {printed} is in none of {', '.join(t.cites)}")
    return problems, checked, skipped


def check_all(files: list[Path]) -> tuple[list[str], list[str], list[str]]:
    """check() over every file; when they include the README and every docs page, each UNCHECKED entry
    must match a table (or a row of a citing table) in one of them."""
    problems, checked, skipped = [], [], []
    seen_unchecked: set = set()
    cache: dict[str, list[float]] = {}
    for path in files:
        p, c, s = check(path, seen_unchecked, cache)
        problems, checked, skipped = problems + p, checked + c, skipped + s
    if {f.resolve() for f in default_files()} <= {f.resolve() for f in files}:
        for header in UNCHECKED:
            if header not in seen_unchecked:
                problems.append("UNCHECKED names no table or row of a citing table in the README or the docs "
                                f"pages: {header}")
    return problems, checked, skipped


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    files = [Path(a) for a in argv] if argv else default_files()
    problems, checked, skipped = check_all(files)
    for line in checked + skipped:
        print(line)
    for p in problems:
        print(p, file=sys.stderr)
    print(f"{len(checked)} tables checked, {len(skipped)} not checked, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
