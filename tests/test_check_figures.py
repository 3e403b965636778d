"""scripts/check_figures.py: every measured figure in the README and the docs pages says what the value its
citation names says."""

import importlib.util
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "check_figures.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120)


def _module():
    spec = importlib.util.spec_from_file_location("check_figures", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_readme_and_docs_figures_are_in_their_result_files():
    proc = _run()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert " 0 problems" in proc.stdout
    checked = int(re.search(r"(\d+) figures checked", proc.stdout)[1])
    assert checked > 1000, proc.stdout  # the README and the pages hold that many cited figures


def test_every_reason_is_in_use_and_every_reason_used_exists(monkeypatch, tmp_path):
    cf = _module()
    files = cf.default_files()
    assert cf.check_all(files).problems == []
    monkeypatch.setitem(cf.REASONS, "stale", (True, "named by no citation"))
    assert cf.check_all(files).problems == ["REASONS has ?stale, which no citation uses"]
    # A file given alone is checked without that rule: the other files may use the reasons.
    assert cf.check_all([REPO / "README.md"]).problems == []
    page = tmp_path / "page.md"
    page.write_text("Ran 1.5x faster.<!-- figures ?no-such-reason -->\n")
    assert cf.check_all([page]).problems == ["page.md:1: 1.5x: unknown reason ?no-such-reason"]


def test_a_figure_that_differs_from_its_value_or_cites_nothing_is_reported(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(
        "## Load\n\n"
        "| clients | off tok/s | off TPOT p50/p95 ms |\n|---|---|---|\n"
        "| 4 | 84.9 | 38 / 40 |\n| 8 | 94.4 | 66 / 999.7 |\n\n"
        "<!-- figures serve_load.json rows: 4 | 8 cols: - | results.off.{row}.tokens_per_s | "
        "results.off.{row}.tpot_p50_ms, results.off.{row}.tpot_p95_ms -->\n\n"
        "Dynamic ran 1.26x always-off at 1 client<!-- figures serve_load.json: results.dynamic.1.tokens_per_s / "
        "results.off.1.tokens_per_s -->, and 1.27x there by total tokens.\n\n"
        "Uncited:\n\n| a | b |\n|---|---|\n| x | 123.4 |\n\n"
        "| option | default |\n|---|---|\n| `--port` | 8000 |\n\n<!-- figures ?options -->\n")
    proc = _run(str(readme))
    assert proc.returncode == 1
    assert f"{readme.name}:6: 999.7 but results.off.8.tpot_p95_ms is 83" in proc.stderr
    assert f"{readme.name}:10: 1.27x: figures with no citation" in proc.stderr
    assert f"{readme.name}:14: a table of figures (123.4 ...) with no citation after it" in proc.stderr
    assert proc.stderr.strip().count("\n") == 2  # 84.9, 38, 40, 94.4, 66 and 1.26x match; 8000 is an option
    assert "6 figures checked, 1 not, 3 problems" in proc.stdout


def _perturbed(text: str, rng: random.Random) -> str:
    """`text` (a printed figure) moved by 1-3 units of its last printed digit, printed the same way."""
    sign, number, exponent, suffix = re.fullmatch(r"([+-]?)([\d,]*\d(?:\.\d+)?)(e[-+]?\d+)?([x%kM]?)", text).groups()
    decimals = len(number.partition(".")[2])
    units = int(number.replace(",", "").replace(".", ""))
    step = rng.randint(1, 3)
    units = units + step if units < step or rng.random() < 0.5 else units - step
    whole, frac = divmod(units, 10 ** decimals)
    moved = (f"{whole:,}" if "," in number else str(whole)) + (f".{frac:0{decimals}d}" if decimals else "")
    return sign + moved + (exponent or "") + suffix


def test_no_figure_moved_by_1_to_3_units_of_its_last_digit_passes(tmp_path):
    cf = _module()
    checked = cf.check_all(cf.default_files()).checked
    rng = random.Random(20261207)
    chosen = rng.sample(checked, 100)
    copies = {p: tmp_path / p.name for p in cf.default_files()}
    lines = {p: p.read_text().split("\n") for p in copies}
    expected = []
    for f in sorted(chosen, key=lambda f: -f.col):  # right to left, so earlier columns stay put
        line = lines[f.path][f.line - 1]
        assert line[f.col:f.col + len(f.text)] == f.text, (f.path.name, f.line, f.text)
        new = _perturbed(f.text, rng)
        assert new != f.text
        lines[f.path][f.line - 1] = line[:f.col] + new + line[f.col + len(f.text):]
        expected.append(f"{f.path.name}:{f.line}: {new} but ")
    for path, copy in copies.items():
        copy.write_text("\n".join(lines[path]))
    problems = cf.check_all(list(copies.values())).problems
    passed = [e for e in expected if not any(p.startswith(e) for p in problems)]
    assert not passed, f"{len(passed)} of 100 moved figures pass: {passed}"
    assert len(problems) == 100, problems
