"""Write docs/cli.md: every `lily` command with all its arguments, read from the command's own parser, so the
page says what `--help` says.

    python scripts/cli_docs.py           # rewrite docs/cli.md
    python scripts/cli_docs.py --check   # exit 1 when docs/cli.md is out of date (tests/test_cli.py runs it)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lily import cli, eval, server, synth
from lily.bench import cli as bench_cli
from lily.info import build_parser as info_parser

DOC = Path(__file__).resolve().parent.parent / "docs" / "cli.md"
HEADER = """# The `lily` command

Every subcommand and every argument, generated from the parsers by `python scripts/cli_docs.py` (a test checks
that this page is current). `lily COMMAND --help` prints the same. Errors print one line, `lily COMMAND: error:
...`, and exit with 2 for bad input or 1 when the work failed.
"""


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _invocation(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.metavar or action.dest.upper()}`"
    value = ""
    if action.nargs != 0:
        value = " " + (action.metavar or action.dest.upper())
        if action.nargs == "?":
            value = f" [{value.strip()}]"
    return ", ".join(f"`{flag}{value}`" for flag in action.option_strings)


def _describe(action: argparse.Action) -> str:
    text = (action.help or "").replace("|", "\\|")
    if action.choices is not None and not isinstance(action, argparse._SubParsersAction):
        text = (text + "; " if text else "") + "one of " + ", ".join(f"`{c}`" for c in action.choices)
    shown_default = action.default not in (None, False, [], argparse.SUPPRESS) and action.option_strings
    if shown_default and str(action.default) not in text:
        text += f" (default `{action.default}`)"
    if isinstance(action, argparse._AppendAction):
        text += " (repeatable)" if "repeatable" not in text else ""
    return text


def _section(name: str, parser: argparse.ArgumentParser, summary: str) -> str:
    positionals = " ".join(_invocation(a).strip("`") for a in parser._actions if not a.option_strings)
    lines = [f"## `lily {name}`", "", summary, "", "```", f"lily {name} {positionals} [options]", "```", ""]
    plain = ("positional arguments", "options", "optional arguments")  # argparse's own groups: one table
    groups = [[a for g in parser._action_groups if g.title in plain for a in g._group_actions]]
    titles = [""]
    for group in parser._action_groups:
        if group.title not in plain:
            groups.append(group._group_actions)
            titles.append(f"{group.title[0].upper()}{group.title[1:]}:")
    for title, actions in zip(titles, groups):
        actions = [a for a in actions if a.help != argparse.SUPPRESS and not isinstance(a, argparse._HelpAction)]
        if not actions:
            continue
        if title:
            lines += [title, ""]
        lines += ["| argument | meaning |", "|---|---|"]
        lines += [f"| {_invocation(a)} | {_describe(a)} |" for a in actions]
        lines.append("")
    return "\n".join(lines)


def render() -> str:
    main = cli._parser()
    commands = _subparsers(main)
    parsers = {"generate": commands["generate"], "chat": commands["chat"], "serve": server.build_parser(),
               "synth": synth.build_parser(), "bench": bench_cli.build_parser(), "eval": eval.build_parser(),
               "info": info_parser()}
    helps = {a.dest: a.help for a in main._subparsers._group_actions[0]._choices_actions}
    parts = [HEADER]
    for name, parser in parsers.items():
        summary = parser.description or helps.get(name) or ""
        if name in ("generate", "chat"):
            summary = helps[name][0].upper() + helps[name][1:] + "."
        parts.append(_section(name, parser, summary))
    return "\n".join(parts).rstrip() + "\n"


def main() -> int:
    text = render()
    if sys.argv[1:] == ["--check"]:
        if DOC.read_text(encoding="utf-8") != text:
            print(f"{DOC} is out of date: run python scripts/cli_docs.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
