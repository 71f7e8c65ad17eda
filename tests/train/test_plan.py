"""``zeroshard train``'s plan is the engine's configuration: the memory table rank 0 prints
and ``--profile``'s table hand the planner ``model.zero_config`` and the engine's layout
(``train/report.layout``), not a subset of their settings.

Issue 26: at stage 2 with ``--offload optimizer`` the table showed 0.139 MB of optimizer
state planned against 0.208 measured, because the bridge asked ``model_state_bytes``
without the offload (the host keeps an fp32 master beside the device's fp32 weights: 4 +
8 bytes an owned element, 208,128 B for the tiny GPT's 17,344 owned elements). Each case
is one real run on 2 gloo ranks, read by both tables.
"""

import re

import pytest

from zeroshard.cli import main
from zeroshard.plan import ParallelDims, ZeroConfig, model_state_bytes

pytestmark = pytest.mark.dist

MB = 1e6
#: every stage that takes an offload, and the weight shards' where the weights are sharded
CASES = [(3, "optimizer"), *(pytest.param(*c, marks=pytest.mark.slow)
                             for c in ((1, "optimizer"), (2, "optimizer"), (3, "params")))]
#: the memory table's row of a rank: measured / planned per category
ROW = re.compile(r"│\s+(\d) │ ([\d.]+) / ([\d.]+) │ ([\d.]+) / ([\d.]+) │ ([\d.]+) / ([\d.]+) │")


def _profile_row(out: str, category: str) -> tuple[str, str, str]:
    """(planned, measured, difference) of ``category`` in ``--profile``'s table."""
    found = re.search(rf"│\s+{category} │\s+([\d.]+) │\s+([\d.]+) │\s+([+-][\d.]+) │", out)
    assert found, out
    return found.groups()


@pytest.mark.parametrize("stage, offload", CASES)
def test_planned_state_is_the_measured_under_offload(tmp_path, capfd, stage, offload):
    assert main(["train", "--nproc", "2", "--model", "tiny", "--steps", "2", "--stage",
                 str(stage), "--offload", offload, "--profile", str(tmp_path),
                 "--eval-every", "100", "--sample-chars", "0"]) == 0
    out = capfd.readouterr().out
    from zeroshard.models.gpt import GPT, get_preset

    params = sum(p.numel() for p in GPT(get_preset("tiny")).parameters())
    weights, _, optimizer = model_state_bytes(params, ParallelDims(2),
                                              ZeroConfig(stage=stage, offload=offload))
    assert optimizer == 12 * params // 2 == 208_128  # the host master is in it
    want = {"params": f"{weights / MB:.3f}", "optimizer": f"{optimizer / MB:.3f}"}
    rows = ROW.findall(out)
    assert [r[0] for r in rows] == ["0", "1"], out
    for _, params_seen, params_planned, _, _, optimizer_seen, optimizer_planned in rows:
        assert (params_seen, params_planned) == (want["params"],) * 2
        assert (optimizer_seen, optimizer_planned) == (want["optimizer"],) * 2
    for category in ("params", "optimizer"):
        assert _profile_row(out, category) == (want[category], want[category], "+0.000")
    # the planned peak counts the state kept off the device, as the profiler does
    share = float(re.search(r"│\s+peak │.*\(([+-][\d.]+)%\)", out).group(1))
    assert abs(share) <= 5.0, out
