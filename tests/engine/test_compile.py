"""torch.compile (inductor) on real gloo processes at N = 2: tiny Hugging Face GPT-2 and
Llama models, the sharded model compiled whole at stages 0 and 3, and each block compiled
before ``zs.shard`` at stage 3 (torchtitan's way), against eager torch DDP. The engine's
hooks stay out of the graphs: compiled whole, a step breaks at each unit's border (and
once more); compiled by unit (before ``zs.shard``, or ``model.compile()`` after), each
block is one graph with no break inside (``compile_cases.py`` counts them)."""

import pytest

from zeroshard.runtime.spawn import spawn

pytestmark = [pytest.mark.dist, pytest.mark.slow]


def _grid():
    from . import compile_cases

    return compile_cases.compile_grid()


@pytest.fixture(scope="module")
def grid():
    return spawn(_grid, 2, timeout=900)[0]


#: Breaks a step runs beyond one at each unit's border and one more, by model: Llama's
#: decoder loop cannot resume after a break (dynamo skips a frame with a graph break in a
#: loop), so its mask and rotary tables compile as two graphs of their own.
OWN = {"hf_gpt2": 0, "hf_llama": 1}


@pytest.mark.parametrize("stage, how", [(0, "model"), (3, "model"), (3, "blocks"),
                                        (3, "units")])
@pytest.mark.parametrize("kind", ["hf_gpt2", "hf_llama"])
def test_compiled_matches_eager_ddp(grid, kind, stage, how):
    r = grid[(kind, stage, how)]
    assert r["diff"] < 1e-5, r
    graphs = r["graphs"][-1]  # the step after compilation
    assert r["graphs"][1:] == [graphs] * (len(r["graphs"]) - 1), r  # no recompilation
    if how == "model":  # breaks: at each unit's border, and one more
        assert graphs - 1 <= r["units"] + 1 + OWN[kind], r
    else:  # each block one graph, the engine's hooks and the root eager around them
        assert graphs == r["units"] - 1 and r["compile_breaks"] == 0, r
