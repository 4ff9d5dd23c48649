"""MkDocs hook: the reference pages generated from the code at every build, so they cannot drift.

``docs/reference/cli.md`` holds ``<!-- msprobe-ci:cli -->``: replaced by every ``msprobe-ci`` command's summary and
its ``-h`` text, from the argparse parsers themselves (:func:`msprobe_ci.cli._parser`). ``docs/reference/
pytest-options.md`` holds ``<!-- msprobe-ci:pytest-options -->``: replaced by tables of every command-line option and
ini key the plugin's own ``pytest_addoption`` registers (run against a recorder that keeps what it is given).

Registered in ``mkdocs.yml`` (``hooks:``); ``python tools/docs_hooks.py cli|pytest-options`` prints a page's text.
"""

from __future__ import annotations

import os
import sys

CLI_MARK = "<!-- msprobe-ci:cli -->"
OPTIONS_MARK = "<!-- msprobe-ci:pytest-options -->"


def cli_markdown() -> str:
    """Every command: a heading, its one-line summary and its full help text (usage, options, examples)."""
    from msprobe_ci.cli import _parser

    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "110"  # argparse wraps at the terminal width: fixed, so the page is the same anywhere
    try:
        parser = _parser()
        parts = [f"```text\n{parser.format_help().rstrip()}\n```"]
        for name, (summary, sub) in parser.commands.items():
            parts.append(f"## msprobe-ci {name}\n\n{summary[0].upper() + summary[1:]}.\n\n"
                         f"```text\n{sub.format_help().rstrip()}\n```")
    finally:
        if old is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old
    return "\n\n".join(parts) + "\n"


class _Recorder:
    """Stands for pytest's parser and option group: keeps every ``addoption`` and ``addini`` call."""

    def __init__(self):
        self.options: list[tuple[tuple[str, ...], dict]] = []
        self.inis: list[tuple[str, dict]] = []

    def getgroup(self, name: str, description: str = "") -> "_Recorder":
        return self

    def addoption(self, *names: str, **kwargs) -> None:
        self.options.append((names, kwargs))

    def addini(self, name: str, help: str = "", type=None, default=None) -> None:  # noqa: A002 (pytest's names)
        self.inis.append((name, {"help": help, "type": type, "default": default}))


def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def options_markdown() -> str:
    """Two tables: the command-line options (with their ini keys) and the ini keys with no option."""
    from msprobe_ci.pytest_plugin.plugin import pytest_addoption

    rec = _Recorder()
    pytest_addoption(rec)
    with_option = {kw.get("dest") for _, kw in rec.options}
    rows = ["| option | value | meaning |", "|---|---|---|"]
    for names, kw in rec.options:
        if kw.get("action") == "store_true":
            value = "flag"
        else:
            value = kw.get("metavar") or "VALUE"
            if kw.get("nargs") == "?":
                value = f"[{value}]"
        text = kw.get("help", "").replace("%%", "%")  # argparse's escape, as --help prints it
        rows.append(f"| `{'`, `'.join(names)}` | `{_cell(value)}` | {_cell(text)} |")
    ini = ["| ini key | default | meaning |", "|---|---|---|"]
    for name, kw in rec.inis:
        if name in with_option:
            continue
        default = kw["default"]
        ini.append(f"| `{name}` | `{_cell(default if default not in (None, '') else '-')}` | {_cell(kw['help'])} |")
    return ("Every option below is also an ini key (named in its text) for `pytest.ini`, `pyproject.toml`'s "
            "`[tool.pytest.ini_options]` or `tox.ini`; the command line wins over the ini file, "
            "`@pytest.mark.msprobe(...)` over both, and a call's own keyword arguments over everything.\n\n"
            + "\n".join(rows) + "\n\n## ini keys without an option\n\n" + "\n".join(ini) + "\n")


def on_page_markdown(markdown: str, page, config, files) -> str:
    """MkDocs event: fill the reference pages' markers."""
    if CLI_MARK in markdown:
        markdown = markdown.replace(CLI_MARK, cli_markdown())
    if OPTIONS_MARK in markdown:
        markdown = markdown.replace(OPTIONS_MARK, options_markdown())
    return markdown


if __name__ == "__main__":
    print(cli_markdown() if sys.argv[1:] == ["cli"] else options_markdown())
