"""The documentation site: MkDocs (Material) builds with --strict, its reference pages are generated from the
parsers and the plugin's own options (so they list everything there is), and the README's links land."""

import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import docs_hooks  # noqa: E402


def test_cli_reference_holds_every_command_and_option():
    from msprobe_ci.cli import _parser

    page = docs_hooks.cli_markdown()
    parser = _parser()
    assert set(parser.commands) == {"compare", "overflow", "graph", "view", "api-check"}
    for name, (summary, sub) in parser.commands.items():
        assert f"## msprobe-ci {name}\n" in page and summary[1:] in page
        for action in sub._actions:
            for flag in action.option_strings:
                assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", page), (name, flag)
    assert "--scheduler ADDRESS" in page and "tcp://head:8786" in page  # help text and examples, as -h prints


def test_pytest_options_reference_lists_what_pytest_registers():
    shown = subprocess.run([sys.executable, "-m", "pytest", "--help", "-p", "no:cacheprovider"], capture_output=True,
                           text=True, cwd=ROOT).stdout
    registered = set(re.findall(r"(--msprobe-[a-z0-9-]+)", shown))
    page = docs_hooks.options_markdown()
    listed = set(re.findall(r"`(--msprobe-[a-z0-9-]+)`", page))
    assert len(registered) > 20 and registered == listed
    for key in ("msprobe_round_factor", "msprobe_api_standards", "msprobe_atol"):  # ini keys with no option
        assert f"| `{key}` |" in page


@pytest.mark.skipif(shutil.which("mkdocs") is None and not os.path.exists(os.path.join(os.path.dirname(
    sys.executable), "mkdocs")), reason="mkdocs is not installed (pip install -e '.[docs]')")
def test_site_builds_strict_with_generated_reference(tmp_path):
    mkdocs = shutil.which("mkdocs") or os.path.join(os.path.dirname(sys.executable), "mkdocs")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    r = subprocess.run([mkdocs, "build", "--strict", "-d", str(tmp_path / "site")], cwd=ROOT, capture_output=True,
                       text=True, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    cli = (tmp_path / "site" / "reference" / "cli" / "index.html").read_text(encoding="utf-8")
    options = (tmp_path / "site" / "reference" / "pytest-options" / "index.html").read_text(encoding="utf-8")
    assert "msprobe-ci:cli" not in cli and "msprobe-ci api-check" in cli and "--num_workers" in cli
    assert "msprobe-ci:pytest-options" not in options and "--msprobe-bench-kernel" in options
    for page in ("getting-started", "gate-your-model", "verdicts", "loops", "multi-rank", "mindspore", "large-jobs",
                 "dumps-are-data"):
        assert (tmp_path / "site" / page / "index.html").is_file()


def test_readme_links_land():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as fh:
        text = fh.read()
    targets = re.findall(r"\]\(((?!https?://)[^)#]+)\)", text)
    assert len(targets) >= 12
    for t in targets:
        assert os.path.exists(os.path.join(ROOT, t)), t
