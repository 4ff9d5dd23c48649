"""The package as users install it: ``msprobe_ci`` outside ``pytest_plugin/`` loads no test framework, and every
package folder is one setuptools ships. (The built wheel itself is installed and run outside the checkout by
``tools/installed_smoke.sh``, in ``.ci/run`` and the ``installed`` CI job.)"""

import ast
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HARNESS = {"pytest", "_pytest", "pluggy"}
#: import name -> folder, as pyproject.toml's package-dir maps them
FOLDERS = {"msprobe_ci": "msprobe_ci", "msprobe_ci.pytest_plugin": "pytest_plugin", "msprobe_ci.checkers": "checkers"}


def _library_files():
    """Every .py file of the library: ``msprobe_ci/`` and ``checkers/`` (the plugin folder is mapped elsewhere)."""
    for folder in ("msprobe_ci", "checkers"):
        for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, folder)):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            yield from (os.path.join(dirpath, f) for f in filenames if f.endswith(".py"))


def _harness_imports(path):
    """(line, name) of every import of a test framework in ``path``, at any depth, ``__import__``/``import_module``
    of a constant name included."""
    with open(path, encoding="utf-8") as fh:
        tree = ast.parse(fh.read(), path)
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and getattr(node.func, "id", getattr(node.func, "attr", None)) in ("__import__", "import_module")):
            names = [node.args[0].value]
        found += [(node.lineno, n) for n in names if n.split(".")[0] in HARNESS]
    return found


def test_the_library_outside_the_plugin_imports_no_test_framework():
    bad = {os.path.relpath(p, ROOT): hits for p in _library_files() if (hits := _harness_imports(p))}
    assert not bad, f"msprobe_ci outside pytest_plugin/ imports a test framework: {bad}"


def test_the_scan_sees_every_way_of_importing():
    # the scan itself can fail: each form of import it must see, in a file of its own
    import tempfile

    forms = ["import pytest", "from _pytest.main import Session", "def f():\n    import pluggy",
             "x = __import__('pytest')", "import importlib\nimportlib.import_module('_pytest.python')"]
    with tempfile.TemporaryDirectory() as tmp:
        for i, src in enumerate(forms):
            path = os.path.join(tmp, f"m{i}.py")
            with open(path, "w", encoding="utf-8") as fh:
                fh.write(src + "\n")
            assert _harness_imports(path), src
        clean = os.path.join(tmp, "clean.py")
        with open(clean, "w", encoding="utf-8") as fh:
            fh.write("import torch\nfrom msprobe_ci.pytest_plugin import plugin\n")
        assert _harness_imports(clean) == []


def test_a_precision_debugger_user_loads_no_test_framework(tmp_path):
    """Every library module imported and PrecisionDebugger run for two steps in a fresh interpreter: none of
    pytest, _pytest, pluggy is in sys.modules after it."""
    script = textwrap.dedent(f"""
        import importlib, pkgutil, sys
        import msprobe_ci
        for mod in pkgutil.walk_packages(msprobe_ci.__path__, "msprobe_ci."):
            if ".pytest_plugin" not in mod.name:
                importlib.import_module(mod.name)
        import torch
        from msprobe_ci import PrecisionDebugger
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
        debugger = PrecisionDebugger(dump_path={str(tmp_path / "dump")!r}, level="mix")
        for _ in range(2):
            debugger.start(model)
            model(torch.randn(3, 8)).sum().backward()
            debugger.stop()
            debugger.step()
        print(sorted(m for m in {sorted(HARNESS)!r} if m in sys.modules))
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout
    assert (tmp_path / "dump" / "step1" / "rank" / "dump.json").is_file()


def test_stacks_stop_at_the_harness_wherever_the_plugin_is_installed():
    """The call-stack walk stops at the loaded harness packages, found by module, not by a checkout path."""
    from msprobe_ci.capture import session

    dirs = session._harness_dirs()
    plugin = os.path.dirname(sys.modules["msprobe_ci.pytest_plugin"].__file__) + os.sep
    assert plugin in dirs and os.path.dirname(pytest.__file__) + os.sep in dirs


@pytest.mark.parametrize("name", sorted(FOLDERS))
def test_every_package_folder_is_found_by_setuptools(name):
    """setup.py's discovery lists every folder holding an ``__init__.py`` (a hand-kept list once missed two)."""
    pytest.importorskip("setuptools")  # a venv of Python 3.12+ has none; the built wheel is checked by .ci/run
    done = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import runpy, setuptools, json
        seen = {}
        setuptools.setup = lambda **kw: seen.update(kw)
        runpy.run_path("setup.py")
        print(json.dumps(seen["packages"]))
    """)], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    import json

    found = set(json.loads(done.stdout))
    folder = os.path.join(ROOT, FOLDERS[name])
    on_disk = set()
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        if "__init__.py" in filenames:
            rel = os.path.relpath(dirpath, folder)
            on_disk.add(name if rel == "." else f"{name}.{rel.replace(os.sep, '.')}")
    if name == "msprobe_ci":
        on_disk = {p for p in on_disk if not p.startswith(("msprobe_ci.pytest_plugin", "msprobe_ci.checkers"))}
    assert on_disk and on_disk <= found, sorted(on_disk - found)
