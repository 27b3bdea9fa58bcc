"""The README a newcomer reads: short, with the two commands at its top, quick starts that are valid Python, and
links that lead to pages of the docs site."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def test_fits_on_a_few_screens():
    assert len(README.splitlines()) <= 250


def test_opens_with_the_demo_and_the_test_command():
    commands = re.findall(r"```bash\n(.*?)\n```", README, re.S)
    assert commands[:2] == ["bash scripts/demo.sh", "bash scripts/test.sh"]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "bash scripts/test.sh" in ci, "CI runs exactly the README's test command"


def test_python_blocks_compile():
    blocks = re.findall(r"```python\n(.*?)```", README, re.S)
    assert len(blocks) >= 2
    for number, block in enumerate(blocks):
        compile(block, f"README.md python block {number}", "exec")


def test_links_into_the_repository_exist():
    targets = [t for t in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README) if "://" not in t]
    assert any(t.startswith("docs/") for t in targets)
    missing = [t for t in targets if not (ROOT / t).exists()]
    assert not missing, missing
