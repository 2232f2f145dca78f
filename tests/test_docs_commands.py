"""Every `raysc` command line in the code blocks of README.md and docs/ is one the CLI accepts: its
subcommand and flags parse, and its config file and `--set` overrides load (keys that exist, values of
the right type, a valid layout). Usage summaries with placeholders (`CONFIG`, `[--step N]`) are read
with the placeholders filled in. What each command then does is run by the tests of its feature and,
for the README's, as a newcomer would (tests/test_newcomer.py, tests/test_connect.py)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from raysc.cli import build_parser
from raysc.config import load_config

ROOT = Path(__file__).resolve().parents[1]
PLACEHOLDERS = {
    "CONFIG": "jobs/configs/tiny.toml",
    "RUN_DIR": "runs/tiny",
    "RUN": "runs/tiny",
    "N": "8",
    "C": "1e21",
    "D": "1e9",
    "T": "1e6",
    "K=V": "train.steps=10",
    "DIR": "runs/x",
    "FILE": "x.gguf",
    "URI": "s3://bucket/run",
    "DOMAIN": "prose",
    "key=value": "train.steps=10",
}


def _command_lines() -> list[tuple[str, str]]:
    """(file:line, command) for each `raysc ...` line in a fenced code block (continuations joined,
    comments dropped)."""
    out = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        block, held, start = False, "", 0
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if line.strip().startswith("```"):
                block = not block
                continue
            if not block:
                continue
            text = (held + " " + line.strip()).strip()
            start = start if held else n
            if text.endswith("\\"):
                held = text[:-1]
                continue
            held = ""
            m = re.match(r"^(?:[A-Z_]+=\S+ )*(raysc .*)", text)
            if m:
                out.append((f"{path.relative_to(ROOT)}:{start}", m.group(1)))
    return out


def _argv(command: str) -> list[str]:
    """The command's argv: shell words up to a comment, optional [..] parts taken in (brackets dropped),
    alternatives ((--a X | --b Y), f32|f16) reduced to the first, placeholders filled."""
    command = re.sub(r"\(([^)]*)\)", lambda m: m.group(1).split(" | ")[0], command)  # (--a X | --b Y)
    words = []
    for word in shlex.split(command, comments=True)[1:]:
        word = word.strip("[]").split("|")[0]
        words.append(PLACEHOLDERS.get(word, word))
    return [w for w in words if w and w != "..."]


COMMANDS = _command_lines()


def test_the_docs_have_command_lines_to_check():
    assert len(COMMANDS) >= 40  # README's 21 and the docs' own: a parser change that finds none fails here


@pytest.mark.parametrize("where,command", COMMANDS, ids=[w for w, _ in COMMANDS])
def test_a_documented_command_parses_and_its_config_loads(where, command):
    argv = _argv(command)
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:
        raise AssertionError(f"{where}: `{command}` does not parse (exit {e.code}): argv {argv}") from None
    overrides = getattr(args, "overrides", None) or []
    config = getattr(args, "config", None)
    if config or overrides:
        if config and config.endswith(".toml"):
            assert (ROOT / config).is_file(), f"{where}: {config} does not exist"
        load_config(str(ROOT / config) if config and config.endswith(".toml") else None, overrides)
