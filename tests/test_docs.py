"""The README's promises that code can check: its two set-up commands (CI runs exactly the test command), links
that lead somewhere, no leftover section markers."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")


def test_two_setup_commands_and_ci_runs_the_test_command():
    section = README.split("## Set-up (two commands)", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"```bash\n(.*?)\n```", section, re.DOTALL)
    assert len(commands) == 2 and commands[0].startswith("pip install . && ") and "\n" not in commands[0]
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    assert ci[-1] == commands[1] == "bash scripts/test.sh"


def test_links_lead_to_files():
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = doc.read_text(encoding="utf-8")
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text):
            assert (doc.parent / target).exists(), f"{doc.name}: link to {target}"
        assert "<!-- section" not in text, doc.name
