"""`zeroshard demo` prints the source documents' two lines from a real 4-rank run."""

import pytest

from zeroshard.cli import main

pytestmark = pytest.mark.dist


def test_demo_prints_the_two_lines(capsys):
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "max |w_DDP - w_ZeRO1| after 50 steps = 0.00e+00" in out
    assert "Adam state floats across all ranks: DDP 80, ZeRO-1 20  (P = 10, N = 4)" in out
    # read after backward, before the step and zero_grad() let the gradients go
    assert "gradient floats held across all ranks: DDP 40, ZeRO-2 10" in out
