"""scripts/check_figures.py: the tables of measured figures in the README and the docs pages say what their
result files say."""

import importlib.util
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
    assert "0 problems" in proc.stdout
    # The default is the README and every docs page; the manual's tables are in the pages.
    assert "README.md line " in proc.stdout and "docs/measurements.md line " in proc.stdout


def test_every_unchecked_entry_names_a_table_in_the_readme_or_the_docs(monkeypatch):
    cf = _module()
    files = cf.default_files()
    assert cf.check_all(files)[0] == []
    monkeypatch.setitem(cf.UNCHECKED, "| no | such | table |", "stale")
    problems = cf.check_all(files)[0]
    assert problems == ["UNCHECKED names no table or row of a citing table in the README or the docs pages: "
                        "| no | such | table |"]
    # A file given alone is checked without that rule: the other files may hold the entries.
    assert cf.check_all([REPO / "README.md"])[0] == []


def test_a_figure_missing_from_its_file_is_reported(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("## Load\n\nFrom `benchmarks/results/serve_load.json`:\n\n"
                      "| clients | off tok/s | off TPOT p50/p95 ms |\n|---|---|---|\n"
                      "| 4 | 84.9 | 38 / 40 |\n| 8 | 94.4 | 66 / 999.7 |\n\n"
                      "Uncited:\n\n| a | b |\n|---|---|\n| x | 123.4 |\n")
    proc = _run(str(readme))
    assert proc.returncode == 1
    assert f"{readme.name}:8: 999.7 is in none of benchmarks/results/serve_load.json" in proc.stderr
    assert proc.stderr.count("is in none of") == 1  # 84.9, 38, 40, 94.4 and 66 are in the file
    assert "line 12: cites no result file, 1 figures not checked" in proc.stdout
