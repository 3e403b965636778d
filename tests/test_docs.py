"""The documentation: the MkDocs site builds in strict mode, the README stays a front door, its links and
pictures resolve, and the shell commands the README and the docs pages show name `medusa` subcommands and
flags that exist."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
RESULTS = REPO / "benchmarks" / "results"
README_MAX_LINES = 300
SHELL_BLOCKS = ("bash", "sh", "shell", "console")
PROGRAMS = ("medusa", ".venv/bin/medusa")
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)")


def pages() -> list[Path]:
    return [REPO / "README.md", *sorted(DOCS.glob("*.md"))]


def shell_blocks(text: str) -> list[tuple[str, list[str]]]:
    """(language, lines) of every fenced bash/sh/shell/console block, fences inside list items included."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.groups()
        body, i = [], i + 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
            i += 1
        i += 1
        if lang.lower() in SHELL_BLOCKS:
            blocks.append((lang.lower(), body))
    return blocks


def commands(lang: str, body: list[str]) -> list[str]:
    """The commands of one block: continuation lines joined; in a console block, the `$ ` lines only."""
    out, pending = [], ""
    for line in body:
        if lang == "console":
            if pending:
                line = line.strip()
            elif line.startswith("$ "):
                line = line[2:]
            else:
                continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        command = (pending + line).strip()
        pending = ""
        if command and not command.startswith("#"):
            out.append(command)
    return out


def medusa_args(command: str) -> list[str] | None:
    """The arguments a command passes to the `medusa` command line (`medusa ...`, `.venv/bin/medusa ...`,
    `python -m medusa.cli ...` under a launcher), or None when it does not run it."""
    try:
        words = shlex.split(command, comments=True)
    except ValueError:
        return None
    while words and ENV_ASSIGNMENT.match(words[0]):
        words = words[1:]
    if words and words[0] in PROGRAMS:
        return words[1:]
    for i, word in enumerate(words[:-1]):
        if word in ("-m", "--module") and words[i + 1] == "medusa.cli":
            return words[i + 2:]
    return None


NESTED = {"datastore"}  # subcommands whose flags belong to an action (`medusa datastore build --out ...`)


def documented() -> dict[str, dict[str, list[str]]]:
    """subcommand ('' for the bare command) -> flag -> where it is shown (file: command)."""
    found: dict[str, dict[str, list[str]]] = {}
    for page in pages():
        for lang, body in shell_blocks(page.read_text()):
            for command in commands(lang, body):
                args = medusa_args(command)
                if args is None:
                    continue
                positional = [a for a in args if not a.startswith("-")]
                sub = positional[0] if positional and args.index(positional[0]) == 0 else ""
                if sub in NESTED and len(positional) > 1 and args.index(positional[1]) == 1:
                    sub = f"{sub} {positional[1]}"  # `medusa datastore build`: the action's own flags
                flags = found.setdefault(sub, {})
                for arg in args:
                    if arg.startswith("--"):
                        flags.setdefault(arg.split("=", 1)[0], []).append(f"{page.relative_to(REPO)}: {command}")
    return found


# `medusa [SUB] --help` for every subcommand, in one process (each start of the command line costs seconds).
HELP_DRIVER = r"""
import contextlib, io, json, sys
from medusa.cli import main
out = {}
for sub in sys.argv[1:]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        try:
            code = main([*sub.split(), "--help"])
        except SystemExit as exc:
            code = exc.code
    out[sub] = [code if isinstance(code, int) else (0 if code is None else 1), buf.getvalue()]
print(json.dumps(out))
"""


@lru_cache(maxsize=1)
def help_texts(subs: tuple[str, ...]) -> dict[str, tuple[int, str]]:
    env = dict(os.environ, COLUMNS="200")
    proc = subprocess.run([sys.executable, "-c", HELP_DRIVER, *subs], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {sub: (code, text) for sub, (code, text) in json.loads(proc.stdout.strip().splitlines()[-1]).items()}


def test_mkdocs_builds_strictly(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs is not installed (scripts/setup.sh installs the docs extra)")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                           str(REPO / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
                          cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (tmp_path / "site" / "index.html").is_file()


def test_readme_is_a_front_door():
    lines = len((REPO / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES}: move text to docs/)"


def test_readme_links_resolve():
    text = (REPO / "README.md").read_text()
    links = [m.group(1).split("#")[0] for m in re.finditer(r"\]\(([^)\s]+)\)", text)]
    local = [link for link in links if link and not re.match(r"^[a-z]+:", link)]
    assert local, "the README links to no docs page"
    missing = [link for link in local if not (REPO / link).exists()]
    assert not missing, f"README.md links to missing files: {missing}"


def test_pictures_are_copies_of_their_results():
    """docs/img/ holds copies of pictures in benchmarks/results (MkDocs serves only files under docs/)."""
    shown = {m.group(1) for page in DOCS.glob("*.md")
             for m in re.finditer(r"!\[[^\]]*\]\(img/([^)\s]+)\)", page.read_text())}
    copies = {p.name for p in (DOCS / "img").iterdir()} if (DOCS / "img").is_dir() else set()
    assert shown <= copies, f"pictures shown but not in docs/img: {sorted(shown - copies)}"
    for name in sorted(copies):
        source = RESULTS / name
        assert source.is_file(), f"docs/img/{name} has no source in benchmarks/results"
        assert (DOCS / "img" / name).read_bytes() == source.read_bytes(), (
            f"docs/img/{name} differs from benchmarks/results/{name}: copy it again")


def test_the_command_parser_sees_what_the_pages_show():
    """The extraction the next test relies on: continuations, env prefixes, launchers, console prompts."""
    text = ("- item:\n  ```bash\n  A=1 B=2 medusa bench --tree tree-8 \\\n      --json x.json   # note\n  ```\n"
            "```console\n$ .venv/bin/medusa serve --port=9000\nINFO started\n```\n"
            "```bash\ntorchrun --nproc_per_node 2 -m medusa.cli train --config C\npython x.py --medusa\n```\n"
            "```python\nmedusa --nothing\n```\n")
    found = [medusa_args(c) for lang, body in shell_blocks(text) for c in commands(lang, body)]
    assert found == [["bench", "--tree", "tree-8", "--json", "x.json"], ["serve", "--port=9000"],
                     ["train", "--config", "C"], None]


def test_documented_subcommands_and_flags_exist():
    shown = documented()
    assert {"generate", "serve", "eval", "train"} <= set(shown), sorted(shown)
    helps = help_texts(tuple(sorted(shown)))
    problems = []
    for sub, flags in sorted(shown.items()):
        code, text = helps[sub]
        name = f"medusa {sub}".strip()
        if code != 0:
            where = next(iter(flags.values()), ["?"])[0] if flags else "?"
            problems.append(f"`{name} --help` exits {code} (shown in {where}): {text.strip()[-300:]}")
            continue
        for flag, where in sorted(flags.items()):
            if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text):
                problems.append(f"`{name}` has no {flag} (shown in {where[0]})")
    assert not problems, "\n".join(problems)


def test_the_installed_command_runs():
    """The `medusa` entry point itself (beside the interpreter), as the pages call it."""
    program = Path(sys.executable).parent / "medusa"
    if not program.exists():
        pytest.skip(f"no medusa command beside {sys.executable}")
    proc = subprocess.run([str(program), "--help"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for sub in documented():
        assert not sub or sub.split()[0] in proc.stdout, f"`medusa --help` does not list {sub}"


# Runs `medusa ARGS...` for each JSON line of stdin in one process (the model loads once per command, but the
# interpreter and imports only once); auto mode's calibration is kept short and out of the user's cache.
RUN_DRIVER = r"""
import contextlib, io, json, sys
from pathlib import Path
import medusa.runtime.calibrate as cal
cal.TOKENS, cal.REPEATS = [1, 2, 4, 8], 1
cal.calibration_path = lambda key: Path(sys.argv[1]) / "curve.json"
from medusa.cli import main
out = []
for line in sys.stdin.read().splitlines():
    args = json.loads(line)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        try:
            code = main(args)
        except SystemExit as exc:
            code = exc.code
    out.append([args, code if isinstance(code, int) else (0 if code is None else 1), buf.getvalue()[-1500:]])
print(json.dumps(out))
"""


# Subcommands whose documented commands run in seconds on the embedded model: the test below runs each as shown.
SHORT = {"generate", "crossover", "export", "calibrate"}


def test_documented_short_commands_run(tmp_path):
    """Every `medusa generate | crossover | export | calibrate` the pages show runs as shown (generate cut to 2
    new tokens, `~` a fresh home directory), except those reading what a training or build command elsewhere
    in the pages writes under runs/, or naming a placeholder, a hub model or a named model (a download of a
    GB or more, and as much memory again: not a test's to make)."""
    from medusa.decoding.target.model import NAMED_MODELS

    shown = {tuple(args) for page in pages() for lang, body in shell_blocks(page.read_text())
             for command in commands(lang, body) if (args := medusa_args(command)) and args[0] in SHORT}
    home = tmp_path / "home"
    home.mkdir()

    def runnable(args: tuple[str, ...]) -> bool:
        return not any(w.startswith("runs/") or w.isupper() or w.startswith("FasterDecoding/") or w in NAMED_MODELS
                       for w in args)

    def as_run(args: tuple[str, ...]) -> list[str]:
        args = [str(home / w[2:]) if w.startswith("~/") else w for w in args]
        return args + ["--max-new-tokens", "2"] if args[0] == "generate" else args

    runnable_args = sorted(a for a in shown if runnable(a))
    assert {a[0] for a in runnable_args} == SHORT and len(runnable_args) >= 12, runnable_args
    lines = "\n".join(json.dumps(as_run(a)) for a in runnable_args)
    proc = subprocess.run([sys.executable, "-c", RUN_DRIVER, str(tmp_path)], input=lines, cwd=REPO,
                          capture_output=True, text=True, timeout=1200, env=dict(os.environ, HOME=str(home)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == len(runnable_args)
    failed = [f"medusa {' '.join(args)} -> exit {code}: {out}" for args, code, out in results if code != 0]
    assert not failed, "\n".join(failed)
