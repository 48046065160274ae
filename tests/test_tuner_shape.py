"""The tuner stays a set of parts a reader can hold in their head: every module of ``tuner/``
under 300 lines, no class with more than 17 attributes (the largest now: the simulated host's
17, the host's free-CPU reader's 16, the tuner's own 15). A module that outgrows this splits
by what its parts decide, as the estimator did (``samples``: what a timing says of a count)."""

from __future__ import annotations

import ast
from pathlib import Path

TUNER = Path(__file__).resolve().parent.parent / "tuner"
MOST_LINES, MOST_ATTRIBUTES = 300, 17


def _attributes(cls: ast.ClassDef) -> set[str]:
    """What a class holds: ``self.x = ...`` anywhere in it, and its annotated fields."""
    names = {n.target.id for n in cls.body
             if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    for node in ast.walk(cls):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and \
                isinstance(node.value, ast.Name) and node.value.id == "self":
            names.add(node.attr)
    return names


def test_every_tuner_module_is_under_300_lines_and_no_class_holds_over_17_attributes():
    modules = sorted(TUNER.glob("*.py"))
    assert len(modules) > 20  # the tuner's parts, not an empty folder
    long = {m.name: n for m in modules if (n := len(m.read_text().splitlines())) > MOST_LINES}
    assert long == {}
    wide = {}
    for m in modules:
        for cls in ast.walk(ast.parse(m.read_text())):
            if isinstance(cls, ast.ClassDef) and len(_attributes(cls)) > MOST_ATTRIBUTES:
                wide[f"{m.name}:{cls.name}"] = len(_attributes(cls))
    assert wide == {}


def test_the_attribute_count_sees_what_a_class_assigns():
    cls = ast.parse("class A:\n    x: int\n    def f(self):\n        self.y = self.z = 1\n"
                    "        w = self.q\n").body[0]
    assert _attributes(cls) == {"x", "y", "z"}
