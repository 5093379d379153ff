"""The CLI's self-documentation: every command's --help lists its exit statuses, every trainer option
has help text, docs/cli.md is what the commands print, and docs/index.md links every doc."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from sentinel.cli import main
from sentinel.cli.docgen import _commands

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
COMMAND_PATHS = [path for path, _, _ in _commands()]


def test_every_command_is_walked():
    assert len(COMMAND_PATHS) >= 18 and "sentinel rules check" in COMMAND_PATHS and "sentinel status" in COMMAND_PATHS


@pytest.mark.parametrize("path", COMMAND_PATHS)
def test_every_help_has_an_exit_status_section(path):
    res = CliRunner().invoke(main, [*path.split()[1:], "--help"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    section = res.output.split("Exit status:", 1)
    assert len(section) == 2, f"`{path} --help` has no Exit status section"
    codes = re.findall(r"^\s+(\d+)\s{2,}\S", section[1], re.MULTILINE)
    assert "0" in codes and "2" in codes, (path, codes)  # success, and the one-line error
    assert codes == sorted(codes, key=int), codes


def test_status_exit_status_option_is_documented_with_its_code():
    out = CliRunner().invoke(main, ["status", "--help"]).output
    assert "--exit-status" in out and re.search(r"^\s+1\s+with --exit-status: a run is HUNG, stale or paused", out, re.MULTILINE)


def test_every_trainer_option_has_help_text():
    from trainer.__main__ import build_parser

    p = build_parser()
    missing = [a.option_strings for a in p._actions if a.option_strings and not (a.help or "").strip()]
    assert not missing, f"options without help: {missing}"
    out = subprocess.run([sys.executable, "-m", "trainer", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--max-steps N" in out.stdout and "--seed S" in out.stdout


def test_cli_reference_is_generated_and_current():
    text = (DOCS / "cli.md").read_text()
    # in a fresh process: click caches each command's help option the first time it is invoked, so a test
    # that ran a command outside the `sentinel` group (no -h) earlier in this session changes render() here
    p = subprocess.run([sys.executable, "-m", "sentinel.cli.docgen"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout == text, "docs/cli.md is stale: run `python -m sentinel.cli.docgen > docs/cli.md`"
    for path in COMMAND_PATHS:
        assert f"\n## {path}\n" in text, path
    assert "## python -m trainer" in text and text.count("Exit status:") == len(COMMAND_PATHS)


def test_docs_index_links_every_doc():
    index = (DOCS / "index.md").read_text()
    links = set(re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", index))
    docs = {str(p.relative_to(DOCS)) for p in [*DOCS.glob("*.md"), *DOCS.glob("*/*.md")] if p.name != "index.md"}
    assert not docs - links, f"docs/index.md does not link: {sorted(docs - links)}"
    for link in links:
        assert (DOCS / link).resolve().is_file(), f"docs/index.md links a missing file: {link}"
    assert isinstance(main, click.Group)
