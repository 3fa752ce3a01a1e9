"""The house rules that code can check: no module over 400 lines, and parts that own their state:
no class whose methods read attributes of `self` that the class itself never sets (a mixin that
reaches into the state another file's class keeps). The classes still built that way are named
here, and the list may only shrink."""

import ast
import glob
import os

import pytest

pytestmark = pytest.mark.unit

PACKAGE = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", "elastic_zero"))
MAX_LINES = 400

# classes that still read what others set: none since issue 44; a new one must be named here, and justified
STILL_MIXED: set[str] = set()


def _modules():
    return sorted(glob.glob(os.path.join(PACKAGE, "**", "*.py"), recursive=True))


def foreign_reads(source: str) -> dict[str, list[str]]:
    """class name -> the attributes of `self` its methods read that no class of the module sets (in
    its methods or as its class attributes, a dataclass's fields among them): what only another
    file's class can set. Classes with a base from outside the package (torch's nn.Module, a
    NamedTuple, an Enum) are not judged: their attributes come from there."""
    tree = ast.parse(source)
    classes = [n for n in tree.body if isinstance(n, ast.ClassDef)]
    # the package's own classes: this module's, and those it imports from the package
    imports = [n for n in tree.body if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("elastic_zero")]
    own = {cls.name for cls in classes} | {alias.asname or alias.name for n in imports for alias in n.names}
    owned, reads = set(), {}
    for cls in classes:
        read = reads.setdefault(cls.name, set())
        for node in cls.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                owned.add(node.name)
            elif isinstance(node, ast.Assign):
                owned.update(n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name))
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                owned.add(node.target.id)
        for node in ast.walk(cls):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
                (owned.add if isinstance(node.ctx, ast.Store) else read.add)(node.attr)
    found = {}
    for cls in classes:
        if any(not isinstance(b, ast.Name) or b.id not in own for b in cls.bases):
            continue
        foreign = sorted(reads[cls.name] - owned)
        if foreign:
            found[cls.name] = foreign
    return found


def test_no_module_is_over_400_lines():
    long = {os.path.relpath(p, PACKAGE): n for p in _modules() if (n := sum(1 for _ in open(p))) > MAX_LINES}
    assert long == {}


def test_no_class_reads_what_another_file_sets_but_those_still_named():
    mixed = set()
    for path in _modules():
        with open(path) as fh:
            for name in foreign_reads(fh.read()):
                mixed.add(f"{os.path.relpath(path, PACKAGE)}:{name}")
    assert mixed - STILL_MIXED == set(), "a class reads attributes it never sets: give it what it needs"
    assert STILL_MIXED - mixed == set(), "no longer mixed: take it off STILL_MIXED"


def test_the_check_sees_a_mixin():
    """The rule's own oracle: a mixin that reads its host's attribute, set in another file, and a
    class that owns what it reads."""
    mixin = "class Reads:\n    def f(self):\n        return self.pool\n"
    owner = ("class Owns:\n    def __init__(self, pool):\n        self.pool = pool\n"
             "    def f(self):\n        return self.pool\n")
    assert foreign_reads(mixin) == {"Reads": ["pool"]}
    assert foreign_reads(owner) == {}
