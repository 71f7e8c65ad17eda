"""Every row of docs/bad-inputs.md's trainers section gets exactly its one line."""

from __future__ import annotations

import re

import pytest

from zeroshard.runtime.spawn import spawn

from . import bad_cases

ROWS = bad_cases.rows()


def _expected(line: str, tmp: str) -> re.Pattern:
    parts = [re.escape(p.replace("{tmp}", tmp)) for p in line.split("…")]
    return re.compile(".*".join(parts), re.DOTALL)


@pytest.fixture(scope="module")
def lines(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("bad"))
    return folder, spawn(bad_cases.run_rows, 1, folder, ROWS, timeout=600)[0]


def test_the_section_lists_both_trainers():
    assert len(ROWS) >= 25
    assert any(code.startswith("Trainer(") for code, _ in ROWS)
    assert any("ZeroShardStrategy" in code for code, _ in ROWS)


@pytest.mark.dist
@pytest.mark.parametrize("k", range(len(ROWS)), ids=[c[:60] for c, _ in ROWS])
def test_a_row_gets_its_one_line(lines, k):
    folder, got = lines
    code, want = ROWS[k]
    assert "\n" not in got[k].strip(), got[k]
    assert _expected(want, folder).fullmatch(got[k]), f"{code}:\n got  {got[k]}\n want {want}"
