"""Docs that run: every ```python block of README.md and docs/*.md is executed.

Blocks are found anew on each run, so a block added to any page is covered without touching this
file. A block runs in a fresh namespace, in an empty temporary directory with ``$CAS_STORE``
naming a store there (``cas.open()`` opens it). An HTML comment right before a block (invisible
on the rendered page) may give it what the page leaves out or excuse it:

    <!-- docs-test: setup
    model = torch.nn.Linear(4, 4)
    -->

runs that code first (in the same namespace), and

    <!-- docs-test: skip: needs an S3 endpoint -->

skips the block with that reason. Only a few blocks may be skipped: the ones that need a server
or a framework's training setup that a page cannot spell out in a few lines.
"""

from __future__ import annotations

import re
import signal
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^(?P<indent>[ \t]*)```python[ \t]*\n(?P<body>.*?)^(?P=indent)```", re.M | re.S)
MARKER = re.compile(r"<!--\s*docs-test:[ \t]*(?P<kind>skip|setup)[ \t]*:?(?P<text>.*)-->", re.S)
MAX_SKIPPED_SHARE = 0.34
"""At most about a third of the blocks may be skipped: most must run."""


@dataclass(frozen=True)
class Block:
    """One python block of a page: where it is, its code, and what its marker says."""

    page: str
    line: int
    code: str
    setup: str = ""
    skip: str | None = None

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def doc_blocks() -> list[Block]:
    """Every python block of the README and docs, with the marker comment before it."""
    blocks = []
    for page in PAGES:
        text = page.read_text()
        for fence in FENCE.finditer(text):
            line = text.count("\n", 0, fence.start()) + 1
            before = text[: fence.start()].rstrip()
            comment = before[before.rfind("<!--") :] if before.endswith("-->") else ""
            marker = MARKER.fullmatch(comment)
            setup, skip = "", None
            if marker is not None:
                body = textwrap.dedent(marker.group("text").strip("\n"))
                if marker.group("kind") == "skip":
                    skip = " ".join(body.split()) or "no reason given"
                else:
                    setup = body
            code = textwrap.dedent(fence.group("body"))
            blocks.append(Block(str(page.relative_to(ROOT)), line, code, setup, skip))
    return blocks


BLOCKS = doc_blocks()


def test_most_doc_blocks_run_and_each_skip_says_why() -> None:
    assert BLOCKS, "no python blocks found in the docs"
    skipped = [b for b in BLOCKS if b.skip is not None]
    assert len(skipped) <= MAX_SKIPPED_SHARE * len(BLOCKS), [b.id for b in skipped]
    assert all(b.skip != "no reason given" for b in skipped), [b.id for b in skipped]


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_doc_block_runs(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if block.skip is not None:
        pytest.skip(block.skip)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CAS_STORE", str(tmp_path / "store"))
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    namespace: dict[str, object] = {"__name__": "__docs__"}
    try:
        if block.setup:
            exec(compile(block.setup, f"{block.id} (setup)", "exec"), namespace)
        exec(compile(block.code, block.id, "exec"), namespace)
    finally:
        for signum, handler in handlers.items():  # a manager in a block installs its own
            signal.signal(signum, handler)
        for value in namespace.values():  # close what a block left open (managers, stores)
            close = getattr(value, "close", None)
            if callable(close) and type(value).__module__.startswith("cas."):
                close()


def _documented_classes() -> dict[str, type]:
    """The public classes whose methods the docs name in running text."""
    import cas
    from cas.retention.gc import GCPlan
    from cas.retention.plan import ForgetPlan
    from cas.retention.policy import RetentionPolicy
    from cas.training.manager import CheckpointManager

    classes: list[type] = [cas.Repository, RetentionPolicy, ForgetPlan, GCPlan, CheckpointManager]
    named = {cls.__name__: cls for cls in classes}
    return {**named, "repo": cas.Repository, "mgr": CheckpointManager, "plan": ForgetPlan}


INLINE_CALL = re.compile(r"`[^`\n]*?\b(?P<owner>[A-Za-z_]\w*)\.(?P<name>[a-z_]\w*)\(")


def test_methods_the_docs_name_in_running_text_exist() -> None:
    classes = _documented_classes()
    missing = []
    for page in PAGES:
        text = page.read_text()
        for found in INLINE_CALL.finditer(text):
            cls = classes.get(found.group("owner"))
            if cls is not None and not hasattr(cls, found.group("name")):
                line = text.count("\n", 0, found.start()) + 1
                where = f"{page.relative_to(ROOT)}:{line}"
                missing.append(f"{where}: {found.group('owner')}.{found.group('name')}")
    assert not missing, missing
