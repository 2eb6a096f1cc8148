"""The golden-file helper fails with a diff, names the fix, and rewrites in update mode."""

import pytest

from tests.golden import check_golden


def test_equal_text_passes_and_a_change_fails_with_a_diff(tmp_path, monkeypatch):
    for name in ("MESHSHARD_UPDATE_GOLDEN", "MESHSHARD_REGEN_GOLDEN"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "g.txt").write_text("a\nb\n")
    check_golden("g.txt", "a\nb\n", directory=tmp_path)
    with pytest.raises(AssertionError, match=r"(?s)-b\n\+c\n.*--update-golden"):
        check_golden("g.txt", "a\nc\n", directory=tmp_path)
    with pytest.raises(AssertionError, match=r"golden file .*new\.txt does not exist"):
        check_golden("new.txt", "x", directory=tmp_path)


@pytest.mark.parametrize("env", ["MESHSHARD_UPDATE_GOLDEN", "MESHSHARD_REGEN_GOLDEN"])
def test_update_mode_rewrites_the_file(tmp_path, monkeypatch, env):
    for name in ("MESHSHARD_UPDATE_GOLDEN", "MESHSHARD_REGEN_GOLDEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(env, "1")
    check_golden("sub/g.txt", "new\n", directory=tmp_path)
    assert (tmp_path / "sub" / "g.txt").read_text() == "new\n"
    monkeypatch.setenv(env, "0")
    with pytest.raises(AssertionError):
        check_golden("sub/g.txt", "newer\n", directory=tmp_path)
