"""The layer rule holds for the real tree, and the checker catches each kind of violation planted.

``tests/layer_rules.py`` is the checker; its docstring states the rules. The planted trees below
are small ``cas`` packages written to ``tmp_path``, each breaking one rule once, so a checker
that stopped seeing a rule fails here rather than silently passing the real tree.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import cas
from tests.layer_rules import MAX_FLAT, MAX_LINES, Violation, check_tree

CAS_ROOT = Path(cas.__file__).parent

CLEAN_TREE: dict[str, str] = {
    "__init__.py": '"""Face."""\nfrom cas.repo.repository import Repository\n',
    "__main__.py": '"""Main."""\nfrom cas.cli import main\n',
    "errors.py": '"""Errors."""\n',
    "digest.py": '"""Digests."""\nfrom cas.errors import CASError\n',
    "blobstore/__init__.py": '"""Blobs."""\n',
    "blobstore/base.py": '"""Base."""\nclass BlobStore:\n    pass\n',
    "blobstore/local.py": (
        '"""Local."""\nfrom cas.blobstore.base import BlobStore\n'
        "class LocalBlobStore(BlobStore):\n    pass\n"
    ),
    "model/__init__.py": '"""Model."""\n',
    "model/state.py": '"""State."""\ndef tensor():\n    import torch\n    return torch\n',
    "objects/__init__.py": '"""Objects."""\n',
    "objects/store.py": (
        '"""Objects."""\nfrom cas.blobstore.base import BlobStore\n'
        "class ObjectStore:\n    def __init__(self, blobs: BlobStore) -> None:\n"
        "        self.blobs = blobs\n"
    ),
    "refs/__init__.py": '"""Refs."""\n',
    "refs/store.py": '"""Refs."""\nfrom cas.objects.store import ObjectStore\n',
    "retention/__init__.py": '"""Retention."""\n',
    "retention/gc.py": '"""GC."""\nfrom . import plan\nfrom cas.refs.store import ObjectStore\n',
    "retention/plan.py": '"""Plan."""\nfrom cas.digest import CASError\n',
    "repo/__init__.py": '"""Repo."""\n',
    "repo/repository.py": (
        '"""Repository."""\nfrom typing import TYPE_CHECKING\n'
        "from cas.retention.gc import plan\nif TYPE_CHECKING:\n    import torch\n"
        "class Repository:\n    def blob_count(self) -> int:\n        return self.blobs.count\n"
    ),
    "fs/__init__.py": '"""Fs."""\n',
    "fs/views.py": '"""Views."""\nfrom cas.repo.repository import Repository\n',
    "training/__init__.py": '"""Training."""\n',
    "training/integrations/__init__.py": '"""Integrations."""\n',
    "training/integrations/plugin.py": (
        '"""A torch plugin: its base class needs torch when the class is defined."""\n'
        "from torch.distributed.checkpoint.storage import StorageWriter\n"
        "class Writer(StorageWriter):\n    pass\n"
    ),
    "cli/__init__.py": '"""CLI."""\nfrom cas.fs.views import Repository\ndef main() -> None:\n'
    "    pass\n",
    "testing/__init__.py": '"""Testing."""\nfrom cas.cli import main\n',
}


def plant(tmp_path: Path, changes: dict[str, str]) -> Path:
    """The clean tree with ``changes`` (path -> source) written over it; returns its root."""
    root = tmp_path / "cas"
    for rel, source in {**CLEAN_TREE, **changes}.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    return root


def only(violations: list[Violation], rule: str) -> Violation:
    """The single violation of ``rule``, with every violation in the failure message."""
    matching = [v for v in violations if v.rule == rule]
    assert len(matching) == 1, "\n".join(map(str, violations))
    return matching[0]


def test_the_cas_tree_obeys_the_layer_rules() -> None:
    violations = check_tree(CAS_ROOT)
    assert not violations, f"{len(violations)} layer violations:\n" + "\n".join(
        map(str, violations)
    )


def test_a_clean_planted_tree_has_no_violation(tmp_path: Path) -> None:
    assert check_tree(plant(tmp_path, {})) == []


@pytest.mark.parametrize(
    ("rel", "source", "line"),
    [
        ("objects/chunks.py", '"""Up."""\nfrom cas.refs.store import ObjectStore\n', 2),
        (
            "retention/verify.py",
            '"""Function-level, relative to a sibling package."""\ndef run() -> None:\n'
            "    from ..sync import transfer\n",
            3,
        ),
        (
            "refs/typed.py",
            '"""Annotations count."""\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n'
            "    import cas.repo.repository\n",
            4,
        ),
    ],
)
def test_an_import_of_a_higher_or_equal_rank_is_caught(
    tmp_path: Path, rel: str, source: str, line: int
) -> None:
    changes = {rel: source, "sync/__init__.py": '"""Sync."""\n'}
    found = only(check_tree(plant(tmp_path, changes)), "upward-import")
    assert (found.path, found.line) == (f"cas/{rel}", line)


def test_an_import_cycle_between_modules_of_one_package_is_caught(tmp_path: Path) -> None:
    changes = {"retention/plan.py": '"""Plan."""\nimport cas.retention.gc\n'}
    found = only(check_tree(plant(tmp_path, changes)), "import-cycle")
    assert found.path in ("cas/retention/gc.py", "cas/retention/plan.py")
    assert "cas.retention.gc -> cas.retention.plan -> cas.retention.gc" in found.message


def test_an_import_cycle_between_packages_is_caught_besides_the_upward_edge(
    tmp_path: Path,
) -> None:
    changes = {"objects/store.py": '"""Objects."""\nfrom cas.refs import store\n'}
    violations = check_tree(plant(tmp_path, changes))
    cycles = [v for v in violations if v.rule == "import-cycle"]
    assert any("package import cycle: cas.objects -> cas.refs" in v.message for v in cycles)
    assert any("module import cycle" in v.message for v in cycles)
    assert only(violations, "upward-import").path == "cas/objects/store.py"


def test_importing_the_blobstore_above_the_store_layers_is_caught(tmp_path: Path) -> None:
    changes = {"fs/local.py": '"""Fs."""\nimport cas.blobstore.local\n'}
    found = only(check_tree(plant(tmp_path, changes)), "blobstore-import")
    assert (found.path, found.line) == ("cas/fs/local.py", 2)


def test_a_blobs_attribute_outside_the_store_layers_is_caught(tmp_path: Path) -> None:
    changes = {
        "retention/gc.py": '"""GC."""\ndef run(repo: object) -> None:\n    repo.blobs.delete("x")\n'
    }
    found = only(check_tree(plant(tmp_path, changes)), "blobs-reach-through")
    assert (found.path, found.line) == ("cas/retention/gc.py", 3)


@pytest.mark.parametrize(
    "attribute", ["objects", "refs_store", "io", "leases", "stores", "maintenance"]
)
def test_repository_internals_above_repo_are_caught(tmp_path: Path, attribute: str) -> None:
    changes = {
        "fs/views.py": f'"""Views."""\ndef read(repo: object) -> object:\n    return repo.{attribute}\n'
    }
    found = only(check_tree(plant(tmp_path, changes)), "repo-internals")
    assert (found.path, found.line) == ("cas/fs/views.py", 3)
    assert f".{attribute}" in found.message


def test_isinstance_against_a_backend_class_outside_blobstore_is_caught(tmp_path: Path) -> None:
    changes = {
        "objects/sweep.py": '"""Sweep."""\nfrom cas.blobstore.local import LocalBlobStore\n'
        "def local(blobs: object) -> bool:\n    return isinstance(blobs, (int, LocalBlobStore))\n"
    }
    found = only(check_tree(plant(tmp_path, changes)), "backend-isinstance")
    assert (found.path, found.line) == ("cas/objects/sweep.py", 4)


def test_isinstance_against_the_blobstore_interface_itself_is_allowed(tmp_path: Path) -> None:
    changes = {
        "repo/opening.py": '"""Opening."""\nfrom cas.blobstore.base import BlobStore\n'
        "def given(target: object) -> bool:\n    return isinstance(target, BlobStore)\n"
    }
    assert check_tree(plant(tmp_path, changes)) == []


def test_a_module_over_the_line_limit_is_caught(tmp_path: Path) -> None:
    body = '"""Long."""\n' + "x = 1\n" * MAX_LINES
    found = only(check_tree(plant(tmp_path, {"model/long.py": body})), "module-size")
    assert found.path == "cas/model/long.py"
    assert f"{MAX_LINES + 1} lines" in found.message


def test_too_many_flat_modules_are_caught(tmp_path: Path) -> None:
    flat = {f"flat{i}.py": f'"""Flat {i}."""\n' for i in range(MAX_FLAT)}
    found = only(check_tree(plant(tmp_path, flat)), "flat-modules")
    assert found.path == "cas/"


def test_torch_at_module_level_is_caught_even_where_torch_is_allowed(tmp_path: Path) -> None:
    changes = {"training/rng.py": '"""RNG."""\nimport torch\n'}
    found = only(check_tree(plant(tmp_path, changes)), "torch-at-module-level")
    assert (found.path, found.line) == ("cas/training/rng.py", 2)


def test_torch_outside_the_tensor_modules_is_caught_even_inside_a_function(
    tmp_path: Path,
) -> None:
    changes = {
        "repo/repository.py": '"""Repository."""\ndef load() -> object:\n'
        "    from torch import frombuffer\n    return frombuffer\n"
    }
    found = only(check_tree(plant(tmp_path, changes)), "torch-import")
    assert (found.path, found.line) == ("cas/repo/repository.py", 3)


def test_importing_the_public_face_or_test_support_from_inside_cas_is_caught(
    tmp_path: Path,
) -> None:
    changes = {
        "fs/views.py": '"""Views."""\nimport cas\n',
        "cli/app.py": '"""App."""\nfrom cas.testing import faulty\n',
        "testing/faulty.py": '"""Faults."""\n',
    }
    violations = check_tree(plant(tmp_path, changes))
    assert only(violations, "imports-face").path == "cas/fs/views.py"
    assert only(violations, "imports-testing").path == "cas/cli/app.py"


def test_a_package_missing_from_the_layer_table_is_caught(tmp_path: Path) -> None:
    changes = {"extras/__init__.py": '"""Extras."""\n'}
    found = only(check_tree(plant(tmp_path, changes)), "unknown-package")
    assert found.path == "cas/extras/__init__.py"


def test_a_violation_names_file_line_and_rule() -> None:
    text = str(Violation("cas/fs/views.py", 12, "repo-internals", "uses .io above cas.repo"))
    assert text == "cas/fs/views.py:12: [repo-internals] uses .io above cas.repo"
