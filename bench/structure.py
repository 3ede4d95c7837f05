"""The code's shape, measured (issue 28's measures): functions over 60 lines and modules over 400
outside tests, and how far `train.micro_batch` travels.

    python bench/structure.py [ROOT]

`train.micro_batch` is followed by name through ember/: a *stop* is a function that handles it
(its body names `micro_batch`, or it takes the whole recipe or its [train] section, which carry
it); a *climb back up* is a function that digs it out of the whole recipe (`X.train.micro_batch`)
instead of being handed the value or the section it belongs to. Printed, never asserted."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

CARRIERS = {"Recipe", "TrainConfig"}  # annotations of parameters that carry train.micro_batch


def functions(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def carries(fn: ast.FunctionDef) -> bool:
    args = fn.args.args + fn.args.kwonlyargs + fn.args.posonlyargs
    return any(a.annotation is not None and any(c in ast.unparse(a.annotation) for c in CARRIERS) for a in args)


def names_micro_batch(fn: ast.FunctionDef) -> tuple[bool, bool]:
    named = climbs = False
    for node in ast.walk(fn):
        if isinstance(node, ast.Attribute) and node.attr == "micro_batch":
            named = True
            if isinstance(node.value, ast.Attribute) and node.value.attr == "train":
                climbs = True
        elif isinstance(node, ast.Constant) and node.value == "micro_batch":
            named = True
        elif isinstance(node, ast.Name) and node.id == "micro_batch" or isinstance(node, ast.arg) and node.arg == "micro_batch":
            named = True
    return named, climbs


def main(root: Path) -> None:
    long_fns, big_modules, stops, climbs, files = [], [], 0, 0, set()
    for path in sorted((root / "ember").rglob("*.py")):
        text = path.read_text()
        rel = path.relative_to(root)
        if text.count("\n") > 400:
            big_modules.append((text.count("\n"), str(rel)))
        for fn in functions(ast.parse(text)):
            n = fn.end_lineno - fn.lineno + 1
            if n > 60:
                long_fns.append((n, f"{rel}:{fn.lineno} {fn.name}"))
            named, climbed = names_micro_batch(fn)
            if named or carries(fn):
                stops += 1
                files.add(rel)
            climbs += climbed
    print(f"train.micro_batch: {stops} stops in {len(files)} files, {climbs} climbs back up")
    print(f"functions over 60 lines (outside tests): {len(long_fns)}")
    for n, where in sorted(long_fns, reverse=True):
        print(f"  {n:4d}  {where}")
    print(f"modules over 400 lines: {len(big_modules)}")
    for n, where in sorted(big_modules, reverse=True):
        print(f"  {n:4d}  {where}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1])
