"""``ppctl/cli/app.py`` holds the commands' faces, the work lives below it (``ppctl/run/`` for a launch's).

Read from the source: every function there (a command with its options included) fits on a screen, and
``ppctl/run/`` neither prints through the command line nor exits through it: it raises an exception
whose message is the one line, and the face says it.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "ppctl"
APP = PACKAGE / "cli" / "app.py"
MAX_FUNCTION_LINES = 40


def function_lengths(path: Path) -> dict[str, int]:
    """Every function of ``path`` (nested ones too) -> its lines, from ``def`` to its last line."""
    return {node.name: node.end_lineno - node.lineno + 1 for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}


def test_no_function_of_the_command_line_is_over_40_lines():
    long = {name: lines for name, lines in function_lengths(APP).items() if lines > MAX_FUNCTION_LINES}
    assert not long, f"functions of {APP.name} over {MAX_FUNCTION_LINES} lines: {long}; move the work below"


def test_the_launch_path_calls_neither_typer_nor_the_command_lines_fail():
    for path in sorted((PACKAGE / "run").glob("*.py")):
        tree = ast.parse(path.read_text())
        imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        imported |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        assert not {name for name in imported if name.split(".")[0] in ("typer", "click")}, path
        assert not {name for name in imported if name.startswith("ppctl.cli")}, path
