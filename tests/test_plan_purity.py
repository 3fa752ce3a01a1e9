"""The house rule: plan/ is pure planning, standard library only, no I/O and no clock."""

import ast
import pathlib
import sys

import elastic_zero.plan

PLAN = pathlib.Path(elastic_zero.plan.__file__).parent
FORBIDDEN = {"os", "time", "ray", "torch", "pyarrow", "numpy", "socket", "subprocess", "random"}


def test_plan_imports_only_the_standard_library_and_itself():
    for path in sorted(PLAN.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                assert top not in FORBIDDEN, f"{path.name} imports {name}"
                assert top in sys.stdlib_module_names or name.startswith("elastic_zero.plan") or top == "__future__", (
                    f"{path.name} imports {name}, which is not the standard library"
                )
