"""The verdict's arithmetic and a trial's checks, on plain tensors (no process group)."""

import pytest
import torch

from zeroshard.parity.certificate import Certificate
from zeroshard.parity.outcome import Outcome
from zeroshard.parity.reference import _reduce
from zeroshard.parity.trial import Trial, rows_of
from zeroshard.parity.verdict import (
    BITWISE,
    DIFFERS,
    FLOOR_MARGIN,
    ROUNDING,
    ULP_MARGIN,
    UNIT_ROUNDOFF,
    compare,
    compare_category,
    overall,
)
from zeroshard.spec.config import ZeroConfig

from . import cases

RECIPE = ZeroConfig(mixed_precision="fp32").recipe
U = UNIT_ROUNDOFF["fp32"]


def _ref():
    g = torch.Generator().manual_seed(0)
    return {"a": torch.randn(8, 4, generator=g), "b": torch.randn(4, generator=g)}


def test_equal_tensors_are_bitwise():
    ref = _ref()
    d = compare_category("weights", {k: v.clone() for k, v in ref.items()}, ref, [ref], RECIPE)
    assert d.verdict == BITWISE and d.abs_diff == d.rel_diff == 0


def test_a_difference_within_the_floor_is_rounding_and_past_it_differs():
    ref = _ref()
    nudged = {k: v * (1 + 1e-6) for k, v in ref.items()}  # the floor: 1e-6 relative
    floor = (nudged["a"] - ref["a"]).abs().max() / ref["a"].abs().max()
    bound = FLOOR_MARGIN * floor.item() + ULP_MARGIN * U
    near = {"a": ref["a"] * (1 + 5e-6), "b": ref["b"].clone()}
    d = compare_category("weights", near, ref, [nudged], RECIPE)
    assert d.verdict == ROUNDING and d.where == "a" and d.rel_diff <= d.bound
    assert d.bound == pytest.approx(bound, rel=1e-3)
    far = {"a": ref["a"].clone(), "b": ref["b"] * 1.001}
    d = compare_category("weights", far, ref, [nudged], RECIPE)
    assert d.verdict == DIFFERS and d.where == "b" and d.rel_diff == pytest.approx(1e-3, rel=1e-3)


def test_a_noise_tensor_is_held_to_its_own_floor():
    """A tensor that is rounding noise (its floor near 1) does not hide a real difference
    in another: each tensor against its own bound."""
    ref = _ref()
    ref["noise"] = torch.full((4,), 1e-12)
    nudged = {**ref, "noise": torch.full((4,), -1e-12)}
    ours = {**ref, "noise": torch.full((4,), 5e-13), "a": ref["a"] * 1.01}
    d = compare_category("gradients, step 1", ours, ref, [nudged], RECIPE)
    assert d.verdict == DIFFERS and d.where == "a"


def test_missing_tensors_and_shapes_differ_with_a_note():
    ref = _ref()
    d = compare_category("weights", {"a": ref["a"]}, ref, [ref], RECIPE)
    assert d.verdict == DIFFERS and d.where == "b" and "lacks 1 tensor" in d.note
    d = compare_category("weights", {"a": ref["a"].T, "b": ref["b"]}, ref, [ref], RECIPE)
    assert d.verdict == DIFFERS and "shape (4, 8)" in d.note


def test_initial_weights_allow_no_difference():
    ref = _ref()
    ours = {k: torch.nextafter(v, torch.full_like(v, 10.0)) for k, v in ref.items()}
    d = compare_category("initial weights", ours, ref, [ref], RECIPE)
    assert d.verdict == DIFFERS and d.bound == 0 and "build_model" in d.note


def test_the_worst_category_decides_and_the_certificate_says_it():
    ref = Outcome(initial=_ref(), weights=_ref(), grads=_ref(),
                  losses={"step 1, rank 0": torch.tensor(2.5)})
    ours = Outcome(initial=_ref(), weights={**_ref(), "b": _ref()["b"] * 2}, grads=_ref(),
                   losses={"step 1, rank 0": torch.tensor(2.5)})
    rows = compare(ours, ref, [ref], RECIPE)
    assert [r.verdict for r in rows] == [BITWISE, BITWISE, BITWISE, DIFFERS]
    assert overall(rows) == DIFFERS and overall(rows[:3]) == BITWISE
    cert = Certificate(overall(rows), rows, "t", "r")
    assert not cert.ok and cert.first_difference.category == "weights"
    assert cert.summary().startswith("DIFFERS: weights: relative difference 1 in b")


def test_the_reference_reduces_in_rank_order_then_divides_and_nudges_by_one_ulp():
    parts = [{"g": torch.tensor([1.0, 3.0, 0.1])}, {"g": torch.tensor([2.0, 5.0, 0.2])}]
    assert torch.equal(_reduce(parts, 2, None)["g"], (parts[0]["g"] + parts[1]["g"]) / 2)
    nudged = _reduce(parts, 2, torch.Generator().manual_seed(3))["g"]
    exact = _reduce(parts, 2, None)["g"]
    ulps = (nudged - exact).abs() / torch.finfo(torch.float32).eps / exact.abs()
    assert (ulps <= 1.01).all() and not torch.equal(nudged, exact)


def test_rows_of_a_global_batch():
    x, y = torch.arange(8).reshape(4, 2), torch.arange(4)
    assert torch.equal(rows_of((x, y), 1, 2)[0], x[2:]) and rows_of({"y": y}, 0, 4)["y"] == 0


@pytest.mark.parametrize("change,message", [
    ({"nproc": 3}, "do not divide over nproc=3"),
    ({"nproc": 0}, "nproc=0; expected a positive integer"),
    ({"batches": []}, "batches is empty"),
    ({"clip": -1.0}, "clip=-1.0; expected a positive number"),
    ({"config": ZeroConfig(mixed_precision="fp16")}, "verify replays fp32 and bf16"),
    ({"config": ZeroConfig(stage=3, quantize_grads=True)}, "round weights and gradients"),
    ({"build_model": "gpt"}, "build_model='gpt' is not callable"),
])
def test_a_trial_refuses_what_it_cannot_check(change, message):
    kw = dict(build_model=cases.gpt, build_optimizer=cases.adamw, batches=cases.batches(),
              config=ZeroConfig())
    with pytest.raises(ValueError, match=message):
        Trial(**{**kw, **change})


def test_rows_that_disagree_within_a_batch_are_refused():
    x = torch.zeros(4, 3)
    with pytest.raises(ValueError, match=r"batches\[0\]: its tensors have \[3, 4\] rows"):
        Trial(cases.gpt, cases.adamw, [(x, torch.zeros(3))], ZeroConfig())
