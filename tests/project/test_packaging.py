"""One version everywhere: the package, its metadata, the command and the CHANGELOG.

The wheel itself (its files, a fresh environment running it) is checked in .ci/run.
"""

import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import pytest

import zeroshard
from zeroshard import cli
from zeroshard._version import __version__

ROOT = Path(__file__).resolve().parents[2]


def test_one_version():
    assert re.fullmatch(r"\d+\.\d+\.\d+", __version__)
    assert zeroshard.__version__ == __version__
    # the installed metadata is built from the same assignment (pyproject's attr:)
    installed = importlib.metadata.version("zeroshard")
    assert installed == __version__, f"installed metadata says {installed}: pip install -e ."
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^dynamic = \["version"\]', pyproject, re.M)
    assert 'attr = "zeroshard._version.__version__"' in pyproject
    assert not re.search(r"^version = \"", pyproject, re.M)


def test_version_flag(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"zeroshard {__version__}\n"


def test_python_m_version():
    out = subprocess.run([sys.executable, "-m", "zeroshard", "--version"],
                         capture_output=True, text=True, check=True).stdout
    assert out == f"zeroshard {__version__}\n"


def test_changelog_names_the_version():
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert re.search(rf"^## \[{re.escape(__version__)}\]", changelog, re.M)
