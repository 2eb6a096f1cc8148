"""The one golden-file helper: compare text with ``tests/golden/<name>``, or rewrite it.

Every golden test calls :func:`check_golden`.  To accept new output, rerun the tests
with ``pytest --update-golden`` (or ``MESHSHARD_UPDATE_GOLDEN=1``; the older
``MESHSHARD_REGEN_GOLDEN=1`` still works) and review ``git diff tests/golden``: the diff
is what a person checks.
"""

from __future__ import annotations

import difflib
import os
import pathlib

GOLDEN_DIR = pathlib.Path(__file__).parent / "golden"
UPDATE_ENV = ("MESHSHARD_UPDATE_GOLDEN", "MESHSHARD_REGEN_GOLDEN")


def updating() -> bool:
    """True when golden files are to be rewritten (``--update-golden`` or the env var)."""
    return any(os.environ.get(name, "") not in ("", "0") for name in UPDATE_ENV)


def check_golden(name: str, text: str, *, directory: pathlib.Path = GOLDEN_DIR) -> None:
    """Assert ``text`` equals golden file ``name``; in update mode write it instead.

    A mismatch fails with a unified diff (golden -> actual) and the command that
    accepts the new text; a missing file fails the same way.
    """
    path = directory / name
    if updating():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return
    how = f"if the change is intended, rerun with --update-golden and review git diff {path}"
    if not path.exists():
        raise AssertionError(f"golden file {path} does not exist; {how}")
    want = path.read_text()
    if text != want:
        diff = "".join(
            difflib.unified_diff(
                want.splitlines(keepends=True),
                text.splitlines(keepends=True),
                fromfile=f"golden/{name}",
                tofile="actual",
            )
        )
        raise AssertionError(f"text differs from golden file {path}:\n{diff}\n{how}")
