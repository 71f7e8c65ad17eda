"""``zs.verify`` against known outcomes: configurations the test suite proves exact come
out bitwise or within rounding, with the bound printed; deliberately wrong ones come out
DIFFERS, naming the category and the tensor."""

import functools

import pytest

import zeroshard as zs
from zeroshard.parity.verdict import BITWISE, DIFFERS, ROUNDING

from . import cases

pytestmark = pytest.mark.dist


def _verify(model, optimizer, stage, precision, **kw):
    return zs.verify(getattr(cases, model), cases.OPTIMIZERS.get(optimizer, optimizer),
                     cases.batches(), {"stage": stage, "mixed_precision": precision}, **kw)


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_adamw_on_the_gpt_is_bitwise(stage, precision):
    """N = 2: a + b is b + a, each rank's slice is the reference's, the recipe's casts are
    the engine's: every tensor equal."""
    cert = _verify("gpt", "adamw", stage, precision)
    assert cert.verdict == BITWISE, cert.summary()
    assert cert.ok and [r.verdict for r in cert.rows] == [BITWISE] * len(cert.rows)
    categories = [r.category for r in cert.rows]
    assert categories[:4] == ["initial weights", "losses", "gradients, step 1", "weights"]
    assert {"optimizer exp_avg", "optimizer exp_avg_sq", "optimizer step"} <= set(categories)


def test_muon_on_the_gpt_at_stage_3_is_bitwise():
    """Owner computes: torch's Muon on each whole matrix, on one rank."""
    cert = _verify("gpt", "muon", 3, "fp32")
    assert cert.verdict == BITWISE, cert.summary()
    assert "optimizer momentum_buffer" in [r.category for r in cert.rows]


def test_adafactor_with_clipping_is_within_rounding_with_its_bound():
    """Adafactor's statistics are sums of per-rank parts: rounding, held to the bound."""
    cert = _verify("gpt", "adafactor", 2, "bf16", clip=0.5)
    assert cert.ok and cert.verdict in (BITWISE, ROUNDING), cert.summary()
    for r in cert.rows:
        assert r.rel_diff <= r.bound or r.verdict == BITWISE, r
        assert r.category == "initial weights" or r.bound > 0, r
    assert {"optimizer row_var", "optimizer col_var"} <= {r.category for r in cert.rows}


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_a_hugging_face_llama_at_stage_3_bf16(optimizer):
    cert = _verify("llama", optimizer, 3, "bf16")
    assert cert.verdict == BITWISE, cert.summary()


def test_a_shard_stepped_as_if_whole_differs_and_is_named():
    cert = _verify("gpt", cases.rows_as_whole, 2, "fp32")
    assert cert.verdict == DIFFERS and not cert.ok
    rows = {r.category: r for r in cert.rows}
    assert rows["gradients, step 1"].verdict == BITWISE  # the reduction is right
    assert rows["weights"].verdict == DIFFERS
    assert rows["weights"].rel_diff > 1e3 * rows["weights"].bound
    assert cert.first_difference.category in ("weights", "losses")
    assert cert.summary().startswith(f"DIFFERS: {cert.first_difference.category}: ")
    assert rows["weights"].where in dict(cases.gpt().named_parameters())


def test_a_reduction_that_forgets_to_divide_differs_at_the_first_gradients():
    cert = zs.verify(cases.gpt_with_a_wrong_divisor, cases.adamw, cases.batches(),
                     {"stage": 2})
    rows = {r.category: r for r in cert.rows}
    assert cert.first_difference.category == "gradients, step 1", cert.summary()
    # summed over N = 2 ranks and not divided: every gradient twice the mean
    assert rows["gradients, step 1"].rel_diff == pytest.approx(1.0, rel=1e-6)
    assert rows["gradients, step 1"].where in dict(cases.gpt().named_parameters())
    assert rows["initial weights"].verdict == BITWISE


def test_a_model_built_differently_on_each_rank_is_named():
    cert = zs.verify(cases.nondeterministic, cases.adamw, cases.batches(2), {"stage": 0})
    first = cert.first_difference
    assert first.category == "initial weights" and "build_model" in first.note
    assert cert.summary() == f"DIFFERS: initial weights: {first.note}"


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_memory_and_traffic_beside_the_planner(optimizer):
    """The ledger's bytes and the traffic are the planner's for the same layout (beside
    Muon: its owner-computes all-to-alls, and AdamW's state for the embeddings)."""
    cert = _verify("gpt", optimizer, 3, "bf16")
    for category in ("params", "grads", "optimizer"):
        measured, planned = cert.memory[category]
        assert planned is not None and measured == pytest.approx(planned, rel=0.01), category
    assert cert.comm["measured"] == pytest.approx(cert.comm["planned"], rel=0.01)
    data = cert.to_dict()
    assert data["verdict"] == BITWISE and len(data["categories"]) == len(cert.rows)


def test_a_schedule_and_partial_builders():
    """``schedule`` is the learning rate's factor on both sides; builders may be partials."""
    cert = zs.verify(cases.gpt, functools.partial(cases.adamw), cases.batches(),
                     {"stage": 1}, schedule=functools.partial(pow, 0.5))
    assert cert.verdict == BITWISE, cert.summary()


@pytest.mark.slow
@pytest.mark.parametrize("model", ["gpt", "llama"])
@pytest.mark.parametrize("optimizer", ["adamw", "muon", "adafactor"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_every_stage_precision_and_optimizer(model, optimizer, precision, stage):
    cert = _verify(model, optimizer, stage, precision, clip=1.0)
    assert cert.ok, cert.summary()
    for r in cert.rows:
        assert r.verdict == BITWISE or r.rel_diff <= r.bound, r
