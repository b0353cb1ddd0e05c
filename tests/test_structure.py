"""Fast tier: scripts/check_structure.py passes on kvzip/ and fails on crafted packages that break its rules (a library
module importing the CLI; a cycle of module-level imports, absolute or relative; a method file over 400 lines); the
package's `__main__`, an entry point like the console script, may import the CLI."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "check_structure.py"


def run(root: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *([str(root)] if root else [])], capture_output=True,
                          text=True, timeout=60)


def package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "pkg"
    for name, text in {"__init__.py": "", "cli/__init__.py": "", **files}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_kvzip_passes():
    got = run()
    assert got.returncode == 0, got.stdout + got.stderr
    assert got.stdout.startswith("ok: ") and "no import cycle" in got.stdout


def test_scripts_and_tests_stay_under_the_line_limit_too():
    """The package's rule holds for every Python file of the repository: the scripts and these tests are read too."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from check_structure import MAX_LINES
    finally:
        sys.path.pop(0)
    root = SCRIPT.parent.parent
    long = [f"{p.relative_to(root)}: {n}" for folder in ("scripts", "tests") for p in sorted((root / folder).rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_LINES]
    assert not long, f"files over {MAX_LINES} lines: {long}"


def test_a_clean_package_passes_with_lazy_cycles_and_cli_imports_inside_cli(tmp_path):
    root = package(tmp_path, {
        "a.py": "import pkg.b\n",
        "b.py": "def later():\n    import pkg.a\n",  # a function-level import: not a cycle at initialisation
        "c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n",
        "m/__init__.py": "from pkg.m import x\n",
        "m/x.py": "from pkg.m import y\n",  # a submodule naming a sibling: the parent package is not an edge
        "m/y.py": "",
        "cli/run.py": "from pkg.cli import other\nimport pkg.a\n",
        "cli/other.py": "",
        "__main__.py": "from pkg.cli import run\n",  # `python -m pkg`: an entry point, like the console script
    })
    got = run(root)
    assert got.returncode == 0, got.stdout
    assert "6 module-level and 2 deferred" in got.stdout


def test_library_importing_the_cli_fails_even_inside_a_function(tmp_path):
    root = package(tmp_path, {"lib.py": "def f():\n    from pkg.cli import run\n", "cli/run.py": ""})
    got = run(root)
    assert got.returncode == 1
    assert got.stdout.strip() == f"{root / 'lib.py'}:2: pkg.lib imports pkg.cli.run: only pkg.cli may import the CLI"


def test_module_level_cycles_fail_absolute_and_relative(tmp_path):
    root = package(tmp_path, {
        "a.py": "from pkg import b\n",
        "b.py": "class K:\n    import pkg.a\n",  # a class body runs at import time
        "s/__init__.py": "",
        "s/x.py": "from .y import f\n",
        "s/y.py": "try:\n    from . import x\nexcept ImportError:\n    pass\n",
    })
    lines = run(root).stdout.strip().splitlines()
    assert lines == ["import cycle among module-level imports: pkg.a <-> pkg.b",
                     "import cycle among module-level imports: pkg.s.x <-> pkg.s.y"]


def test_a_folder_without_init_is_refused(tmp_path):
    got = run(tmp_path)
    assert got.returncode == 2 and "not a package folder" in got.stderr


def test_a_file_over_the_limit_fails(tmp_path):
    body = "x = 1\n" * 401
    root = package(tmp_path, {"methods/__init__.py": "", "methods/big.py": body, "methods/sub/__init__.py": "",
                              "methods/sub/ok.py": "x = 1\n" * 400, "engine.py": body})  # every file counts
    got = run(root)
    assert got.returncode == 1
    assert sorted(got.stdout.strip().splitlines()) == sorted(
        f"{root / where}: 401 lines; a file stays under 400: split it (a method moves its machinery into a module "
        "of its own)" for where in ("engine.py", "methods/big.py"))


def test_a_layer_that_keeps_its_cache_fails(tmp_path):
    """A `...Layer` class under methods/ that assigns self.cache or self.rope_memo, or stores a cache (a parameter
    annotated with a cache class, or one it builds), fails; the same outside methods/, or in a class not named
    `...Layer`, or a layer storing other parameters, passes."""
    root = package(tmp_path, {
        "methods/__init__.py": "",
        "methods/base.py": "class KVCache:\n    pass\n",
        "methods/a.py": ("from pkg.methods.base import KVCache\n"
                         "class MyCache(KVCache):\n    pass\n"
                         "class ALayer:\n    def __init__(self, cache, idx: int):\n        self.cache, self.idx = cache, idx\n"
                         "class BLayer:\n    def __init__(self, memo=None):\n        self.rope_memo = memo\n"
                         "class CLayer:\n    def __init__(self, owner: 'MyCache'):\n        self.owner = owner\n"
                         "class DLayer:\n    def setup(self):\n        self.mine = MyCache()\n"
                         "class FineLayer:\n    def __init__(self, idx: int, rope=None):\n        self.idx, self.rope = idx, rope\n"
                         "class Helper:\n    def __init__(self, cache):\n        self.cache = cache\n"),
        "other.py": "class OutsideLayer:\n    def __init__(self, cache):\n        self.cache = cache\n",
    })
    got = run(root)
    assert got.returncode == 1
    lines = got.stdout.strip().splitlines()
    path = root / "methods" / "a.py"
    assert [line.split(": ", 1)[0] for line in lines] == [f"{path}:{n}" for n in (6, 9, 12, 15)], got.stdout
    assert all("a layer reads what its cache hands it each forward" in line for line in lines)
    assert "ALayer.__init__ keeps self.cache" in lines[0] and "BLayer.__init__ keeps self.rope_memo" in lines[1]
    assert "CLayer.__init__ keeps a cache (self.owner = owner)" in lines[2]
    assert "DLayer.setup keeps a cache it builds (self.mine)" in lines[3]
