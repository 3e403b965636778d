"""The package layout: dependencies point one way, files stay small, private names stay private.

Layers, lowest first: `errors`, `io` (files, configs, the cache), `prompts` (datasets), `decoding`,
`runtime`, then `eval`, `train` and `serve` side by side, then the command line (`cli`, `demo`). A module may import its own layer
and those below it, never one above or beside it. Imports inside functions count too: a lazy import is
still a dependency.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "medusa"
CODE_DIRS = [PACKAGE, ROOT / "benchmarks", ROOT / "scripts"]
MAX_LINES = 400

LAYERS = {"errors": 0, "io": 1, "prompts": 2, "decoding": 3, "runtime": 4, "eval": 5, "train": 5, "serve": 5,
          "cli": 6, "demo": 6}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, module, imported names) for every import of a `medusa` module in `path`."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] == "medusa":
                out.append((node.lineno, node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.ImportFrom) and node.level > 0:
            raise AssertionError(f"{path}:{node.lineno}: relative import (the project imports absolutely)")
        elif isinstance(node, ast.Import):
            out.extend((node.lineno, a.name, []) for a in node.names if a.name.split(".")[0] == "medusa")
    return out


def layer_of(module: str) -> tuple[str, int]:
    parts = module.split(".")
    if len(parts) < 2:  # `from medusa import x` names the sub-module in x; checked by the caller
        return "medusa", -1
    return parts[1], LAYERS[parts[1]]


def package_files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_every_package_module_has_a_layer():
    unplaced = {module_name(p).split(".")[1] for p in package_files() if module_name(p) != "medusa"} - set(LAYERS)
    assert not unplaced, f"modules with no layer in LAYERS: {sorted(unplaced)}"


@pytest.mark.parametrize("path", package_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_point_down(path: Path):
    me = module_name(path)
    if me == "medusa":
        return
    own, level = layer_of(me)
    wrong = []
    for line, module, names in project_imports(path):
        targets = [f"{module}.{n}" for n in names] if module == "medusa" else [module]
        for target in targets:
            other, other_level = layer_of(target)
            if other != own and other_level >= level:
                wrong.append(f"line {line}: {own} (layer {level}) imports {target} (layer {other_level})")
    assert not wrong, f"{me}: " + "; ".join(wrong)


def test_decoding_imports_no_tooling():
    """The rule the layers exist for, stated alone: the decoding core needs nothing that measures, trains
    or serves it."""
    for path in (PACKAGE / "decoding").rglob("*.py"):
        for line, module, _ in project_imports(path):
            assert module.split(".")[1] in ("errors", "io", "decoding"), f"{path.name}:{line} imports {module}"


@pytest.mark.parametrize("path", [p for d in CODE_DIRS for p in sorted(d.rglob("*.py"))],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_no_private_name_crosses_a_module(path: Path):
    leaks = [f"line {line}: {module}.{n}" for line, module, names in project_imports(path)
             for n in names if n.startswith("_")]
    assert not leaks, f"{path.relative_to(ROOT)} imports private names: {leaks}"


@pytest.mark.parametrize("path", [p for d in CODE_DIRS for p in sorted(d.rglob("*.py"))],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_files_are_short(path: Path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(ROOT)} has {lines} lines (at most {MAX_LINES}: split it by topic)"


# Where proposers and step policies are used: their contract (medusa.decoding.proposers.Proposer,
# medusa.decoding.engine.StepPolicy) is explicit, so nothing there probes an object for what it can do.
PROPOSER_USERS = ["decoding/engine.py", "runtime/auto.py", "serve/server.py", "serve/scheduler.py", "serve/policy.py",
                  "serve/admission.py", "serve/proposers.py"]


def duck_typing(path: Path) -> list[str]:
    """hasattr() calls, and getattr() on anything but an HF model (whose config varies by architecture)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("hasattr", "getattr"):
            target = ast.unparse(node.args[0]) if node.args else ""
            if node.func.id == "hasattr" or not target.endswith("hf_model"):
                found.append(f"line {node.lineno}: {node.func.id}({target}, ...)")
    return found


def patched_behaviour(path: Path) -> list[str]:
    """Functions assigned onto another object's attributes (monkey-patching instead of a declared method)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Assign):
            continue
        is_function = isinstance(node.value, ast.Lambda) or (
            isinstance(node.value, ast.Call) and ast.unparse(node.value.func).endswith("partial"))
        for t in node.targets:
            if (is_function and isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                    and t.value.id not in ("self", "cls")):
                found.append(f"line {node.lineno}: {ast.unparse(t)} = ...")
    return found


@pytest.mark.parametrize("name", PROPOSER_USERS)
def test_proposers_are_used_through_their_contract(name: str):
    found = duck_typing(PACKAGE / name)
    assert not found, f"medusa/{name} probes objects instead of using their declared contract: {found}"


@pytest.mark.parametrize("path", package_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_behaviour_is_patched_onto_other_objects(path: Path):
    found = patched_behaviour(path)
    assert not found, f"{path.relative_to(ROOT)} assigns functions onto other objects (declare a method): {found}"


def test_the_checks_see_a_violation(tmp_path: Path):
    """The import walker finds lazy imports and private names, so the tests above can fail."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from medusa.serve.app import _private\n")
    assert project_imports(bad) == [(2, "medusa.serve.app", ["_private"])]
    assert layer_of("medusa.serve.app") == ("serve", 5)
    assert layer_of("medusa.decoding.engine") == ("decoding", 3)
    probe = tmp_path / "probe.py"
    probe.write_text("if hasattr(p, 'attach'):\n    x = getattr(p, 'owns_step', False)\n"
                     "y = getattr(rt.hf_model, 'name_or_path', '')\nauto.attach = lambda b: None\n"
                     "self.ok = lambda: 1\n")
    assert duck_typing(probe) == ["line 1: hasattr(p, ...)", "line 2: getattr(p, ...)"]
    assert patched_behaviour(probe) == ["line 4: auto.attach = ..."]


def mode_tuples(path: Path) -> list[tuple[str, list[str]]]:
    """Module-level tuples of string literals, named as lists of modes, that name at least one proposer kind:
    (name, elements). (Heads names such as `--heads default|medusa|feature` are another vocabulary.)"""
    from medusa.runtime.proposers import KINDS

    found = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Tuple):
            items = [e.value for e in node.value.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
            name = ast.unparse(node.targets[0])
            if (len(items) == len(node.value.elts) and set(items) & set(KINDS)
                    and re.search("MODE|SPECULATIVE|RECOMMEND|OURS|METHOD", name)):
                found.append((name, items))
    return found


@pytest.mark.parametrize("path", package_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_one_vocabulary_of_mode_names(path: Path):
    """Wherever modes are listed (CLI, evaluator, server policy, cost model), the names are those of
    medusa.runtime.proposers: no entry point spells a mode its own way."""
    from medusa.runtime.proposers import MODES

    for name, items in mode_tuples(path):
        strange = sorted(set(items) - set(MODES))
        assert not strange, f"{path.relative_to(ROOT)}: {name} names modes outside the vocabulary: {strange}"


def test_the_vocabulary_check_sees_a_stray_name(tmp_path: Path):
    probe = tmp_path / "probe.py"
    probe.write_text('MODES = ("medusa", "speculative", "plain")\nOTHER = ("hf", "x")\nHEADS = ("default", "medusa")\n')
    assert mode_tuples(probe) == [("MODES", ["medusa", "speculative", "plain"])]


def test_a_step_reads_as_its_four_phases():
    """`Engine.step` is the algorithm: draft, verify pass, accept, commit, each a method of its own, called
    once and in that order; and no proposer kind is told apart inside it."""
    tree = ast.parse((PACKAGE / "decoding" / "engine.py").read_text())
    engine = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Engine")
    step = next(n for n in engine.body if isinstance(n, ast.FunctionDef) and n.name == "step")
    calls = [n.func.attr for n in ast.walk(step) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and isinstance(n.func.value, ast.Name) and n.func.value.id == "self"]
    assert [c for c in calls if c in ("draft", "verify_pass", "accept", "commit")] == \
        ["draft", "verify_pass", "accept", "commit"]
    assert not any(isinstance(n, ast.Call) and ast.unparse(n.func) == "isinstance" for n in ast.walk(step))
    methods = {n.name for n in engine.body if isinstance(n, ast.FunctionDef)}
    assert {"draft", "verify_pass", "accept", "commit"} <= methods


def test_one_tree_vocabulary():
    """Every tree structure names its fields alike: `node_depth` (a tensor, each node's depth), `leaf_paths`
    for a static tree's root-to-leaf paths, `paths` where either kind is searched, `depth_bound` (an int)
    for how many candidates a path can hold."""
    from dataclasses import fields

    from medusa.decoding.trees.tree import TreeBuffers
    from medusa.decoding.verifier import Candidates, RowTrees

    for cls in (TreeBuffers, RowTrees, Candidates):
        names = {f.name for f in fields(cls)}
        assert "node_depth" in names and "depth" not in names, cls.__name__
    assert {"leaf_paths"} <= {f.name for f in fields(TreeBuffers)}
    assert isinstance(Candidates.depth_bound, property)


def test_one_verifier_and_retrieval_named_retrieval():
    """One `Verifier` class (greedy is one of its rules), and retrieval's earlier mode name `suffix` only
    where it is read and rewritten (`current_spelling`; the server's old tree names are matched by pattern)."""
    verifiers, stray = [], []
    for path in package_files():
        tree = ast.parse(path.read_text())
        verifiers += [n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name.endswith("Verifier")]
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(
                    r"(\w+[:+])?suffix(:\w+|\+\w+)?|\+suffix", node.value):
                stray.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}")
    assert verifiers == ["Verifier"]
    # OLD_KIND / OLD_MERGED, and OpenAI's own `suffix` request field.
    allowed = ("medusa/runtime/proposers.py", "medusa/serve/protocol.py")
    assert stray and all(s.startswith(allowed) for s in stray), stray


def test_the_heads_mode_is_named_heads():
    """The mode that drafts with the runtime's heads, of either kind, says so: `heads` in every vocabulary that
    names modes (the CLI's and the evaluator's, the server's policy, the cost model's recommendation); its
    earlier name `medusa` is only read (`RENAMED`), never written."""
    from medusa.eval.config import OURS
    from medusa.eval.costmodel import RECOMMENDABLE
    from medusa.runtime.proposers import MODES, RENAMED, ProposerSpec
    from medusa.serve.config import PolicyConfig
    from medusa.serve.policy import MODES as POLICY_MODES

    for names in (MODES, OURS, POLICY_MODES, RECOMMENDABLE):
        assert "heads" in names and not any(n.startswith("medusa") for n in names), names
    assert RENAMED["medusa"] == "heads" and ProposerSpec.parse("medusa+retrieval").mode == "heads+retrieval"
    assert PolicyConfig(mode="medusa").mode == "heads"


# The files a reader opens to follow one default step (feature head, retrieval grafted, greedy), and the two whose
# bookkeeping it also runs (the acceptance histogram in outputs.py, sampling.py's checks of which rows sample).
DEFAULT_STEP = {"engine.py", "proposers/__init__.py", "proposers/retrieval.py", "proposers/suffix.py",
                "proposers/feature_proposer.py", "trees/dynamic_tree.py", "verifier.py", "target/transformer.py",
                "target/kernels.py", "batch.py"}
BOOKKEEPING = {"outputs.py", "sampling.py"}


def test_the_default_step_runs_in_the_files_docs_engine_names():
    """Every function the default step calls, traced: it runs in the 10 files docs/engine.md walks through,
    plus the two of bookkeeping, and in nothing else of the package."""
    import sys

    import torch

    from conftest import tiny_model
    from medusa.decoding.engine import Engine
    from medusa.decoding.proposers.feature_heads import FeatureHead, FeatureHeadConfig
    from medusa.decoding.proposers.feature_proposer import FeatureProposer
    from medusa.decoding.proposers.retrieval import MergedProposer, Retriever
    from medusa.decoding.target.transformer import Transformer
    from medusa.decoding.trees.dynamic_tree import TreeShape

    model = tiny_model("llama", seed=3, vocab=13)
    engine, c = Engine(Transformer(model), eos_token_ids=None), model.config
    head = FeatureHead(FeatureHeadConfig(c.hidden_size, c.vocab_size, c.vocab_size), model)
    proposer = MergedProposer(FeatureProposer(head, engine.model, TreeShape(8, 3, 3)), Retriever(3, 6))
    batch = engine.new_batch(2, 128, 24)
    proposer.attach(batch)
    engine.add(batch, [0, 1], [[1, 2, 3, 4, 5, 1, 2, 3], [4, 5, 6, 7]], 20)
    engine.step(batch, proposer)  # the head's first catch-up over the prompts
    ran: set[str] = set()
    decoding = PACKAGE / "decoding"

    def calls(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(str(PACKAGE)):
            ran.add(str(Path(frame.f_code.co_filename).relative_to(decoding)))

    sys.setprofile(calls)
    try:
        with torch.inference_mode():
            for _ in range(3):
                engine.step(batch, proposer)
    finally:
        sys.setprofile(None)
    assert ran == DEFAULT_STEP | BOOKKEEPING
    doc = (ROOT / "docs" / "engine.md").read_text()
    assert "**10 files**" in doc and all(Path(f).name in doc for f in DEFAULT_STEP)
