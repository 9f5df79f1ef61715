"""tools/function_lengths.py on a small fixture package: lengths from the AST, limits, --check."""

import importlib.util
import subprocess
import sys
import textwrap

from conftest import REPO

TOOL = REPO / "tools/function_lengths.py"
spec = importlib.util.spec_from_file_location("function_lengths", TOOL)
function_lengths = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = function_lengths  # dataclasses look their module up there
spec.loader.exec_module(function_lengths)


def _body(lines: int) -> str:
    return "".join(f"    x{i} = {i}\n" for i in range(lines - 2)) + "    return 0\n"


def _package(root):
    package = root / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    # long: 11 lines (def, 9 assignments, return), decorated (the decorator is not counted)
    (package / "a.py").write_text(
        "import functools\n\n\n@functools.cache\ndef long():\n" + _body(11) + "\n\n"
        "def short():\n    return 1\n"
    )
    nested = textwrap.dedent(
        """\
        class Thing:
            def method(self):
                def inner():
                    a = 1
                    b = 2
                    c = 3
                    return a + b + c

                return inner()
        """
    )
    (package / "sub" / "b.py").write_text(nested + "\n" * 20)  # a 29-line module
    (package / "notes.txt").write_text("def not_python():\n" * 50)
    return package


def test_lengths_from_the_ast(tmp_path):
    functions, modules = function_lengths.measure([_package(tmp_path)])
    by_name = {f.name: f.lines for f in functions}
    assert by_name == {"long": 11, "short": 2, "Thing.method": 8, "Thing.method.<locals>.inner": 5}
    assert [f.name for f in functions][:2] == ["long", "Thing.method"]  # longest first
    assert {m.path.split("/")[-1]: m.lines for m in modules} == {
        "__init__.py": 0,
        "a.py": 19,
        "b.py": 29,
    }


def test_report_lists_only_what_is_over_the_limits(tmp_path):
    functions, modules = function_lengths.measure([_package(tmp_path)])
    lines, over = function_lengths.report(functions, modules, function_limit=6, module_limit=20)
    text = "\n".join(lines)
    assert over == 3
    assert "    11  " in text and "a.py:5  long" in text and "Thing.method" in text
    assert "inner" not in text and "short" not in text
    assert text.endswith(
        "2 of 4 functions over 6 lines, 1 of 3 modules over 20 lines; longest function long (11)"
    )
    lines, over = function_lengths.report(functions, modules, 80, 500)
    assert over == 0 and lines.count("  none") == 2


def test_command_line_prints_and_checks(tmp_path):
    package = _package(tmp_path)
    run = [sys.executable, str(TOOL), str(package), "--functions", "10", "--modules", "20"]
    printed = subprocess.run(run, capture_output=True, text=True, timeout=60)
    assert printed.returncode == 0, printed.stderr
    assert "a.py:5  long" in printed.stdout
    checked = subprocess.run([*run, "--check"], capture_output=True, text=True, timeout=60)
    assert checked.returncode == 1 and checked.stdout == printed.stdout
    relaxed = [*run[:3], "--functions", "11", "--modules", "29", "--check"]
    assert subprocess.run(relaxed, capture_output=True, timeout=60).returncode == 0
