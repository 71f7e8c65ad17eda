"""What a restart costs, planned (``plan/failures.py``): the loss per failure, the save
interval of Young (1974) and Daly (2006), the checkpoint held against the trainer's, and
``zeroshard plan --time/--recommend --save-every --mtbf-hours``."""

import json
import math
import subprocess
import sys

import pytest

from zeroshard.cli import main
from zeroshard.plan.failures import (
    RestartCost,
    best_save_every,
    checkpoint_bytes,
    daly_interval,
    describe,
    io_seconds,
    plan_restarts,
    restart_cost,
    young_interval,
)
from zeroshard.spec.recipes import RECIPES, get_recipe

DAY = 86_400.0


def test_a_failure_costs_detection_restart_load_and_half_an_interval():
    # 100 steps of 0.5 s between saves: on average 25 s of them are trained again
    cost = RestartCost(100, 0.5, save_s=4.0, detect_s=5.0, restart_s=60.0, load_s=4.0)
    assert cost.rework_s == 25.0
    assert cost.per_failure_s == 5 + 60 + 4 + 25
    assert cost.save_share == 4 / 50
    # a failure a day: 4/50 saving, 94 s lost per 86,400
    assert cost.lost_share(DAY) == pytest.approx(0.08 + 94 / DAY)


def test_the_checkpoint_is_written_and_read_in_parallel_by_every_writer():
    # 7e9 parameters of bf16 mixed AdamW: 4 bytes of master, 8 of moments; 8 writers at
    # 5 GB/s: 84 GB in 2.1 s, and the same to load
    nbytes = checkpoint_bytes(7 * 10**9, get_recipe("bf16-mixed-adamw"))
    assert nbytes == 84 * 10**9
    assert io_seconds(nbytes, 8, 5e9) == 2.1
    cost = restart_cost(100, 0.5, nbytes, 8, 5e9)
    assert (cost.save_s, cost.load_s) == (2.1, 2.1)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_the_checkpoint_is_what_the_trainer_writes(recipe):
    """The trainer's own figure (checkpoint/savedir.py sizes the save folder by it)."""
    from zeroshard.checkpoint.savedir import checkpoint_bytes as trainers

    r = get_recipe(recipe)
    assert checkpoint_bytes(842_496, r) == trainers(842_496, r)


def test_young_and_daly():
    # Young: sqrt(2 · 60 s · 1 day) = 3,220 s
    assert young_interval(60, DAY) == pytest.approx(math.sqrt(2 * 60 * DAY))
    assert young_interval(60, DAY) == pytest.approx(3219.94, abs=0.01)
    # Daly: Young's times (1 + sqrt(r)/3 + r/9), r = C/2M, less C
    r = 60 / (2 * DAY)
    assert daly_interval(60, DAY) == pytest.approx(
        math.sqrt(2 * 60 * DAY) * (1 + math.sqrt(r) / 3 + r / 9) - 60)
    # short saves: Daly within 2% of Young; a save longer than 2M: save every M
    assert daly_interval(60, DAY) / young_interval(60, DAY) == pytest.approx(1, abs=0.02)
    assert daly_interval(3 * DAY, DAY) == DAY
    assert best_save_every(1.0, 60, DAY) == round(daly_interval(60, DAY))


def test_the_best_interval_loses_least():
    """Daly's interval is the minimum of the lost share, to within a step or two."""
    step, save = 0.8, 12.0
    best = best_save_every(step, save, DAY)

    def lost(n):
        return RestartCost(n, step, save, load_s=save).lost_share(DAY)

    assert all(lost(best) <= lost(n) + 1e-6 for n in (best // 2, best - 50, best + 50,
                                                      2 * best))
    assert abs(best - min(range(1, 5 * best), key=lost)) <= 0.01 * best


def test_the_sentence_names_each_part():
    cost = RestartCost(100, 0.5, 4.0, 5.0, 60.0, 4.0)
    text = describe(cost, DAY, " (ZeRO-3)")
    assert text.startswith("restarts (ZeRO-3): a failure costs 94 s (detect 5 s, restart "
                           "60 s, load 4.0 s, 50 steps since the last save 25.0 s); a save "
                           "takes 4.0 s every 100 steps (8.00% of the run); with a failure "
                           "every 24 h 8.11% of the run is lost"), text
    assert f"saving every {best_save_every(0.5, 4.0, DAY)} steps (Daly's interval" in text
    assert "\n" not in text
    cost, _ = plan_restarts(0.5, 84e9, 8, 5e9, mtbf_s=DAY)  # no interval: Daly's
    assert cost.save_every == best_save_every(0.5, 2.1, DAY)
    with pytest.raises(ValueError, match="give save_every or mtbf_s"):
        plan_restarts(0.5, 84e9, 8, 5e9)
    with pytest.raises(ValueError, match="save_every=0 must be a positive number"):
        RestartCost(0, 0.5, 1.0)
    with pytest.raises(ValueError, match="load_s=-1 must be a number >= 0"):
        RestartCost(1, 0.5, 1.0, load_s=-1)


def test_plan_time_and_recommend_price_restarts(capsys):
    argv = ["plan", "--model", "llama2-7b", "--gpus", "8"]
    assert main([*argv, "--time", "--save-every", "100", "--mtbf-hours", "24"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # the sentence, unwrapped
    assert "restarts (ZeRO-1): a failure costs" in out and "100 steps" in out, out
    assert main([*argv, "--time", "--mtbf-hours", "24", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)["restarts"]
    assert data["save_every"] == best_save_every(data["step_s"], data["save_s"], DAY)
    assert data["per_failure_s"] == pytest.approx(
        data["detect_s"] + data["restart_s"] + data["load_s"] + data["rework_s"])
    assert main([*argv, "--recommend", "--mtbf-hours", "24", "--restart-seconds", "30",
                 "--json"]) == 0
    notes = json.loads(capsys.readouterr().out)["recommend"]["notes"]
    assert any(n.startswith("restarts (") and "restart 30 s" in n for n in notes), notes


def test_the_restart_model_never_imports_torch():
    done = subprocess.run([sys.executable, "-c", "import sys, zeroshard.plan.failures; "
                           "assert 'torch' not in sys.modules"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
