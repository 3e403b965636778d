#!/usr/bin/env python
"""Check that every measured figure in the README and the docs pages says what its result file says.

Figures. In a sentence, a table's header or the first cell of a row (its name), a number outside code,
links and comments is a figure when it carries a measure: a ratio (`1.79x`), a percentage (`12%`), a unit
after it (`27 ms`, `2-second`, `12.3/s`, `98.2 tok/s`, `1,939.5 MB`: UNITS), thousands or millions (`799k`,
`40.2M`), or a decimal point (`tau 3.05`, `0.706`, `4.0e-5`). An integer with none of these is a count or
a setting (`8 prompts`, `2 cores`, `25,865 requests`) and no figure, nor is a number glued to a name
(`tree-8`, `Qwen2.5`, `SmolLM2-135M`, `x86`, `K=3`, `an 8,232-prompt run`), a version (`2.13.0`, `4.x`) or
a power (`2^64`). The ends of a range and the members of a list take each other's measure (`65-98%`,
`1,884 -> 1,977 MB`, `27 / 30`). In a table's other cells every number is a figure (the header names units).

Citations. Each figure is checked against one value at its printed precision: 41 matches 40.6 but not
40.46, 12% matches 0.12, 40.2M matches 40,229,697. A paragraph or table with figures cites them in HTML
comments, which pages do not show:

    text with 1.79x and tau 3.05<!-- figures SOURCES: ENTRY, ENTRY -->     one entry per figure, in order
    <!-- figures SOURCES rows: KEY | KEY ... cols: CELL | CELL ... head: CELL | CELL ... -->   a table
    <!-- figures ?REASON -->                                       all figures of the block, one reason

SOURCES are result files (a name in benchmarks/results, or a path from the repository root), each may be
called `NAME=FILE`; the first is the default. A comment in a paragraph cites its figures since the comment
before; one standing after a paragraph or a table (blank lines between allowed) cites the rest of it. A
table's `cols:` gives each column a CELL, the entries for its cells' figures (the first column, the row
names, included), with `{row}` for the row's KEY from `rows:`; or lines `| CELL | CELL | ... |` give the
body rows one by one (an empty cell takes its column's CELL, a line of one `?REASON` covers its row);
`head:` cites the header. `-` or nothing: a cell without figures. A table without figures needs no comment;
one of settings or options says so (`?options`).

An ENTRY is `?REASON` (not checked, or not a figure, as REASONS says; `?REASON*3` stands for three; alone in
a cell, a list or a comment it covers all their figures) or an expression: numbers, `+ - * /` between
spaces, parentheses, min/max/sum/len/mean/median/log2(...) of values and lists, and addresses
`[SOURCE:]PATH` (SOURCE a name from SOURCES, or a file name). A JSON PATH joins keys and list indexes by
dots (`tokens_per_s.auto`, `results.0.tau`), quotes `"a key with.dots"`, takes every child with `*` and the
one record of a list whose fields match with `[k=v&k2=v2]` (`v` may hold `*`; after a `*`, every matching
one): `results[method=*:tree-8&batch_size=1].tau`. In a text or Markdown file PATH is `LINE#N`, the N-th
number on that line. So derived figures are checked too: `1.83x` as `total.auto / total.plain`.

Exit status 1 when a figure differs from its value, figures cite nothing, a citation does not fit its
block, or (checking the README and every docs page, the default) a reason in REASONS is unused.

    python scripts/check_figures.py [--unchecked] [FILE.md ...]   # default: README.md and docs/*.md
"""

from __future__ import annotations

import fnmatch
import json
import math
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"

# `?CODE` -> (a figure?, why it is not checked). Not a figure: the number is no measurement.
REASONS: dict[str, tuple[bool, str]] = {
    "not-kept": (True, "measured by a run whose result file was not kept"),
    "history": (True, "in the repository's history (an earlier result file, a head shipped before), not in the tree"),
    "log": (True, "measured, kept only in a run's own log or the data's notes, not in a result file"),
    "computed": (True, "computed by the project's code from a kept file, not itself stored in one"),
    "estimate": (True, "an estimate or a projection, not a measurement"),
    "outside": (True, "a figure from outside this project (a paper, a vendor's specification)"),
    "setting": (False, "a setting, threshold or constant chosen, not measured"),
    "size": (False, "a size that follows from the model's dimensions, the data or a file, not measured"),
    "options": (False, "a table of options or settings, not of results"),
    "version": (False, "a version number"),
    "example": (False, "an example value or a property of a number format, not a measurement"),
}

UNITS = (r"(?:ms|us|µs|s|min|minutes?|h|hours?|seconds?|days?|KB|MB|GB|TB|KiB|MiB|GiB|GB/s|TB/s|tok/s|"
         r"tokens?/s|positions/s|answer tokens/s)(?![\w/])")
NUM = re.compile(r"(?<![\w.^=/@$#,])(?<![A-Za-z_][-–])(?<![A-Za-z]\d[-–])~?(?P<sign>(?<![\w.])[+-])?"
                 r"(?P<num>\d{1,3}(?:,\d{3})+(?:\.\d+)?(?![\d,])|\d+(?:\.\d+)?(?:e[-+]?\d+)?)(?P<suf>[x%kM])?"
                 r"(?![\w^]|\.\d|\.[A-Za-z]|/\d|,\d)")
MASK = re.compile(r"<!--.*?-->|(`+).+?\1|!\[[^\]]*\]\([^)]*\)|\]\([^)]*\)|https?://\S+", re.S)
COMMENT = re.compile(r"<!--\s*figures\b(.*?)-->", re.S)
FENCE = re.compile(r"\s*(```|~~~)")
SCALE = {"k": 1e3, "M": 1e6, "%": 0.01}
TEXT_NUMBER = re.compile(r"(?<![\w.])(?<![A-Za-z_]-)-?\d+(?:\.\d+)?(?:e[-+]?\d+)?")
SEG = re.compile(r'\.?(?:"([^"]*)"|\[([^\]]+)\]|([^."\[\]]+))')
TOKEN = re.compile(r'\s*(?:(?P<op>[-+*/])(?=\s)|(?P<fn>min|max|sum|len|mean|median|log2)\(|(?P<lp>\()|(?P<rp>\))|'
                   r'(?P<comma>,)|(?P<atom>(?:"[^"]*"|[^\s(),"])+))')
FUNCS = {name: (lambda f: lambda *args: f([x for a in args for x in (a if isinstance(a, list) else [a])]))(f)
         for name, f in {"min": min, "max": max, "sum": sum, "len": len, "mean": statistics.mean,
                         "median": statistics.median, "log2": lambda v: math.log2(*v)}.items()}


@dataclass
class Figure:
    path: Path
    line: int          # 1-based
    col: int           # 0-based: where the printed figure starts in its line
    text: str          # as printed: "1.79x", "+0.41%", "25,865"
    value: float
    half: float        # half a unit of its last printed digit


def blank(m: re.Match) -> str:  # masks code, links and comments, keeping every offset
    return re.sub(r"[^\n]", " ", m.group())


def find_figures(path: Path, text: str, first: int, starts: list[int], every: bool, a: int = 0,
                 b: int | None = None) -> list[Figure]:
    """The figures in text[a:b]; `text` is masked, its lines start at `starts` and the first is line
    `first` of the file; `every`: a table's value cell, where every number is a figure."""
    found = list(NUM.finditer(text, a, len(text) if b is None else b))
    measured: list[bool | None] = []
    for m in found:
        after = text[m.end():]
        name = re.match(r"[-–]([A-Za-z][\w/]*)", after)
        measured.append(None if name and not re.fullmatch(UNITS, name.group(1)) else  # SmolLM2-135M-Instruct
                        every or bool(m["suf"]) or bool(re.search(r"[.e]", m["num"]))
                        or bool(re.match(r"[-–]?\s?" + UNITS, after)))
    for _ in found:  # ranges and lists share their measure
        for i, (x, y) in enumerate(zip(found, found[1:])):
            if None not in measured[i:i + 2] and re.fullmatch(r"\s*(?:[-–]|->|/)\s*", text[x.end():y.start()]):
                measured[i] = measured[i + 1] = measured[i] or measured[i + 1]
    figures = []
    for i, m in [(i, m) for i, m in enumerate(found) if measured[i]]:
        num, sign = m["num"].replace(",", ""), m["sign"] or ""
        suf = m["suf"] or (found[i + 1]["suf"] if i + 1 < len(found) and re.fullmatch(  # 65-98%: 65%
            r"\s*[-–]\s*", text[m.end():found[i + 1].start()]) else "") or ""
        decimals = len(num.split("e")[0].partition(".")[2])
        scale = SCALE.get(suf, 1.0)
        pos = m.start("num") - len(sign)
        line = max(k for k, s in enumerate(starts) if s <= pos)
        figures.append(Figure(path, first + line, pos - starts[line], sign + m["num"] + (m["suf"] or ""),
                              float(num) * scale * (-1 if sign == "-" else 1),
                              0.5 * 10.0 ** (int(num.partition("e")[2] or 0) - decimals) * scale))
    return figures


def json_path(data, path: str):
    items, many, pos = [data], False, 0
    for m in SEG.finditer(path):
        if m.start() != pos:
            break
        pos, (quoted, select, key) = m.end(), m.groups()
        nxt = []
        for x in items if select is None or not many else [items]:
            if select is not None:  # the one record of the list x that matches; after `*`, every one
                conds = [c.split("=", 1) for c in select.split("&")]
                hits = [r for r in x if isinstance(r, dict) and all(
                    k in r and fnmatch.fnmatchcase(str(r[k]), v) for k, v in conds)]
                if not hits or len(hits) > 1 and not many:
                    raise ValueError(f"[{select}] matches {len(hits)} records")
                nxt += hits
            elif key == "*":
                nxt, many = nxt + (list(x.values()) if isinstance(x, dict) else list(x)), True
            else:
                k = quoted if quoted is not None else key
                nxt.append(x[int(k)] if isinstance(x, list) else x[k])
        items = nxt
    if pos != len(path):
        raise ValueError(f"cannot read the path {path!r}")
    return items if many else items[0]


def read(source: str, path: str, cache: dict):
    """The value at `path` in a result file."""
    file = RESULTS / source if "/" not in source else ROOT / source
    if file not in cache:
        cache[file] = json.loads(file.read_text()) if file.suffix == ".json" else file.read_bytes().decode().split("\n")
    if file.suffix == ".json":
        return json_path(cache[file], path)
    line, n = (int(x) for x in path.split("#"))
    return float(TEXT_NUMBER.findall(cache[file][line - 1])[n - 1])


def evaluate(expr: str, sources: dict[str, str], cache: dict):
    """The value of an entry: its addresses read, then its arithmetic done (every token checked first)."""
    code, values, pos = "", [], 0
    while pos < len(expr.rstrip()):
        m = TOKEN.match(expr, pos)
        if not m or m.end() == pos:
            raise ValueError(f"cannot read {expr!r}")
        tok, pos = m[m.lastgroup] + ("(" if m.lastgroup == "fn" else ""), m.end()
        if m.lastgroup == "atom" and not re.fullmatch(r"-?\d+(\.\d+)?", tok):
            name, _, path = tok.partition(":")
            named = path and (name in sources or re.search(r"\.(json|txt|md)$", name))
            values.append(read(sources.get(name, name), path, cache) if named else read(sources[""], tok, cache))
            tok = f"_v[{len(values) - 1}]"
        code += " " + tok
    try:
        return eval(code, {"__builtins__": {}, "_v": values, **FUNCS})  # noqa: S307 - only the tokens above
    except SyntaxError as err:
        raise ValueError(f"cannot read {expr!r}") from err


def split_top(text: str, sep: str) -> list[str]:
    """`text` split at `sep` outside quotes, brackets and parentheses."""
    out, depth, quoted, cur = [], 0, False, ""
    for ch in text:
        quoted ^= ch == '"'
        depth += 0 if quoted else (ch in "[(") - (ch in "])")
        out, cur = (out + [cur.strip()], "") if ch == sep and not depth and not quoted else (out, cur + ch)
    return out + [cur.strip()]


@dataclass
class Citation:
    line: int
    sources: dict[str, str]
    entries: list[str] | None = None  # a paragraph's, or one `?REASON` for a whole block
    rows: list[str] | None = None
    cols: list[str] | None = None
    head: list[str] | None = None
    row_lines: list[list[str]] | None = None


def parse(body: str, line: int) -> Citation:
    lines = body.splitlines()
    rest = "\n".join(x for x in lines if not x.strip().startswith("|"))
    c = Citation(line, {}, row_lines=[split_top(x.strip()[1:-1], "|") for x in lines if x.strip()[:1] == "|"] or None)
    parts = re.split(r"(?:(?<=\s)|^)(rows|cols|head):(?=\s)|(?<=\S):(?=\s|$)", rest)
    for token in parts[0].replace(",", " ").split():
        if token.startswith("?"):
            c.entries = split_top(parts[0], ",")  # `?REASON` or `?R1, ?R2*2, ...` without sources
        else:
            name, _, file = token.rpartition("=")
            c.sources[name] = file
            c.sources.setdefault("", file)
    for label, text in zip(parts[1::2], parts[2::2]):
        setattr(c, label or "entries", split_top(text, "," if label is None else "|"))
    return c


class Checker:
    def __init__(self):
        self.problems, self.checked, self.cache = [], [], {}  # checked: Figures
        self.unchecked: list[tuple[Figure, str]] = []  # with the code of its reason

    def cite(self, figs: list[Figure], entries: list[str], c: Citation, where: str, row: str = ""):
        """Each figure against its entry."""
        entries = [x for e in entries if e not in ("", "-") for x in (
            [e.split("*")[0]] * int(e.split("*")[1]) if re.fullmatch(r"\?[\w-]+\*\d+", e) else [e])]
        if len(entries) == 1 and entries[0].startswith("?"):
            entries = entries * len(figs)
        if len(entries) != len(figs):
            self.problems.append(f"{where}: {len(figs)} figures ({', '.join(f.text for f in figs)}) but "
                                 f"{len(entries)} entries ({', '.join(entries)}) in the citation at line {c.line}")
            return
        for f, e in zip(figs, [e.replace("{row}", row) for e in entries]):
            if e.startswith("?"):
                if e[1:] not in REASONS:
                    self.problems.append(f"{shown(f.path)}:{f.line}: {f.text}: unknown reason {e}")
                self.unchecked.append((f, e[1:]))
                continue
            try:
                value = evaluate(e, c.sources, self.cache)
                if isinstance(value, (bool, list, dict, str)) or value is None:
                    raise ValueError(f"it is {str(value)[:60]}, not a number")
            except (ValueError, KeyError, IndexError, TypeError, OSError, ZeroDivisionError) as err:
                self.problems.append(f"{shown(f.path)}:{f.line}: {f.text}: {e}: {type(err).__name__}: {err}")
                continue
            tie = abs(abs(value - f.value) - f.half) <= f.half * 1e-9  # then the one rounded away from 0
            if abs(f.value) > abs(value) if tie else abs(value - f.value) < f.half:
                self.checked.append(f)
            else:
                self.problems.append(f"{shown(f.path)}:{f.line}: {f.text} but {' '.join(e.split())} is {value:.6g}"
                                     f" ({c.sources.get('', 'no source')})")

    def table(self, path: Path, rows: list[tuple[int, str]], c: Citation | None):
        cells = []  # per row (the header first): the figures of each cell
        for k, (n, line) in enumerate(rows):
            line = MASK.sub(blank, line)
            bars = [m.start() for m in re.finditer(r"(?<!\\)\|", line)]
            cells += [] if k == 1 else [[find_figures(path, line, n, [0], k > 0 and j > 0, x + 1, y)
                                         for j, (x, y) in enumerate(zip(bars, bars[1:]))]]
        where = f"{shown(path)}:{rows[0][0]}"
        every = [f for row in cells for cell in row for f in cell]
        if c is None and every:
            self.problems.append(f"{where}: a table of figures ({', '.join(f.text for f in every[:5])} ...) "
                                 "with no citation after it")
        if c is None or c.entries:  # none, or one list or reason for the whole table
            return c and self.cite(every, c.entries, c, where)
        self.row(cells[0], c.head or [], [], c, where)
        body, keys = cells[1:], c.rows or [""] * (len(cells) - 1)
        lines = c.row_lines or [[] for _ in body]
        if len(keys) != len(body) or len(lines) != len(body):
            self.problems.append(f"{where}: {len(body)} rows but the citation at line {c.line} gives "
                                 f"{len(keys)} keys and {len(lines)} row lines")
            return
        for (n, _), key, own, row in zip(rows[2:], keys, lines, body):
            self.row(row, [key] if key.startswith("?") else own, c.cols or [], c, f"{shown(path)}:{n}", key)

    def row(self, row: list[list[Figure]], own: list[str], cols: list[str], c: Citation, where: str, key=""):
        own = own * len(row) if len(own) == 1 and own[0].startswith("?") else own
        for j, figs in enumerate(row):
            cell = own[j] if j < len(own) and own[j] else (cols[j] if j < len(cols) else "")
            self.cite(figs, split_top(cell, ",") if cell else [], c, f"{where} cell {j + 1}", key)

    def text(self, path: Path, lines: list[str], i: int, j: int) -> list[Figure]:
        """Checks what a paragraph's inline citations cite; returns the figures after its last one."""
        text, starts = "\n".join(lines[i:j]), [0]
        for line in lines[i:j - 1]:
            starts.append(starts[-1] + len(line) + 1)
        figs, done = find_figures(path, MASK.sub(blank, text), i + 1, starts, False), 0
        for m in COMMENT.finditer(text):
            before = [f for f in figs[done:] if starts[f.line - i - 1] + f.col < m.start()]
            line = i + 1 + text.count("\n", 0, m.start())
            c = parse(m[1], line)
            self.cite(before, c.entries or [], c, f"{shown(path)}:{line}")
            done += len(before)
        return figs[done:]

    def page(self, path: Path):
        lines, i, pending = path.read_text().splitlines(), 0, None  # pending: a block waiting for its citation
        while i < len(lines):
            s, j = lines[i].strip(), i + 1
            if s.startswith("<!--"):
                while "-->" not in lines[j - 1]:
                    j += 1
                m = COMMENT.search("\n".join(lines[i:j]))
                if m and pending is None:
                    self.problems.append(f"{shown(path)}:{i + 1}: a citation with no table or text before it")
                elif m:
                    c = parse(m[1], i + 1)
                    if pending[0] == "table":
                        self.table(path, pending[1], c)
                    else:
                        self.cite(pending[1], c.entries or [], c, f"{shown(path)}:{i + 1}")
                    pending = None
                i = j
                continue
            if s:
                self.flush(path, pending)
                pending = None
            if FENCE.match(lines[i]):
                while j < len(lines) and not lines[j].strip().startswith(FENCE.match(lines[i])[1]):
                    j += 1
                j += 1
            elif s.startswith("|"):
                while j < len(lines) and lines[j].strip().startswith("|"):
                    j += 1
                pending = ("table", [(n + 1, lines[n]) for n in range(i, j)])
            elif s and not s.startswith("#"):
                while j < len(lines) and (lines[j].strip() and not FENCE.match(lines[j]) and not lines[j].strip()
                                          .startswith(("|", "#", "<!--")) or "\n".join(lines[i:j]).count("<!--")
                                          > "\n".join(lines[i:j]).count("-->")):
                    j += 1
                pending = ("text", self.text(path, lines, i, j))
            i = j
        self.flush(path, pending)

    def flush(self, path: Path, pending):
        """A block that no citation followed."""
        if pending and pending[0] == "table":
            self.table(path, pending[1], None)
        elif pending and pending[1]:
            self.problems.append(f"{shown(path)}:{pending[1][0].line}: "
                                 f"{', '.join(f.text for f in pending[1])}: figures with no citation")


def shown(path: Path) -> str:
    """A file's name as messages give it: relative to the repository where it lies inside it."""
    return str(path.resolve().relative_to(ROOT)) if path.resolve().is_relative_to(ROOT) else path.name


def default_files() -> list[Path]:
    """The README and every docs page."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def check_all(files: list[Path]) -> Checker:
    """Every figure of the files against its citation; with the README and every docs page, each reason in
    REASONS must be in use."""
    checker = Checker()
    for path in files:
        checker.page(path)
    if {f.resolve() for f in default_files()} <= {f.resolve() for f in files}:
        used = {code for _, code in checker.unchecked}
        checker.problems += [f"REASONS has ?{r}, which no citation uses" for r in REASONS if r not in used]
    return checker


def main(argv: list[str] | None = None) -> int:
    """`--unchecked` lists every figure not checked, with its reason."""
    args = sys.argv[1:] if argv is None else argv
    checker = check_all([Path(a) for a in args if a != "--unchecked"] or default_files())
    print("\n".join(checker.problems), file=sys.stderr)
    for f, code in checker.unchecked if "--unchecked" in args else []:
        print(f"{shown(f.path)}:{f.line}: {f.text}: ?{code}")
    codes = [code for _, code in checker.unchecked]
    for code in sorted(set(codes), key=lambda c: -codes.count(c)):
        figure, why = REASONS.get(code, (True, "unknown reason"))
        print(f"{codes.count(code):4d} {'not checked' if figure else 'not figures'}: ?{code}, {why}")
    print(f"{len(checker.checked)} figures checked, {len(codes)} not, {len(checker.problems)} problems")
    return 1 if checker.problems else 0


if __name__ == "__main__":
    sys.exit(main())
