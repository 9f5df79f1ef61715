"""tools/import_cycles.py on a small fixture package: module-level and lazy circles, --check."""

import importlib.util
import sys

from conftest import REPO

TOOL = REPO / "tools/import_cycles.py"
spec = importlib.util.spec_from_file_location("import_cycles", TOOL)
import_cycles = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = import_cycles
spec.loader.exec_module(import_cycles)


def _package(root, lazy_back: bool):
    package = root / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg.sub import b\n")  # a -> pkg.sub.b
    (package / "sub" / "b.py").write_text("from . import c\nimport os\n")  # b -> pkg.sub.c
    back = "def f():\n    from ..a import x\n" if lazy_back else "from pkg import a\n"
    (package / "sub" / "c.py").write_text(back)  # c -> pkg.a, lazily or at module level
    (package / "d.py").write_text("from pkg.sub.b import name\nfrom pkg import a\n")  # no circle
    return package


def test_a_module_level_circle_is_in_both_graphs(tmp_path):
    modules = import_cycles.module_files(_package(tmp_path, lazy_back=False))
    assert set(modules) == {"pkg", "pkg.sub", "pkg.a", "pkg.sub.b", "pkg.sub.c", "pkg.d"}
    expected = [["pkg.a", "pkg.sub.b", "pkg.sub.c"]]
    assert import_cycles.circles(import_cycles.import_graph(modules, lazy=False)) == expected
    assert import_cycles.circles(import_cycles.import_graph(modules, lazy=True)) == expected


def test_a_lazy_import_hides_a_circle_only_from_the_module_level_graph(tmp_path, capsys):
    package = _package(tmp_path, lazy_back=True)
    modules = import_cycles.module_files(package)
    graph = import_cycles.import_graph(modules, lazy=False)
    assert graph["pkg.sub.c"] == set() and graph["pkg.d"] == {"pkg.sub.b", "pkg.a"}
    assert import_cycles.circles(graph) == []
    lazy = import_cycles.import_graph(modules, lazy=True)
    assert import_cycles.circles(lazy) == [["pkg.a", "pkg.sub.b", "pkg.sub.c"]]
    assert import_cycles.main([str(package)]) == 0
    assert import_cycles.main([str(package), "--check"]) == 1
    assert "pkg.a <-> pkg.sub.b <-> pkg.sub.c" in capsys.readouterr().out
    (package / "sub" / "c.py").write_text("")
    assert import_cycles.main([str(package), "--check"]) == 0
