"""`pagoda bench tensor-parallel`: the projection's arithmetic, and one measured point at TP=2."""

import json

import pytest

from pagoda.bench.tensor_parallel import LINKS, SHAPES, main, project


def test_the_projection_splits_memory_and_charges_the_link():
    shape, link = SHAPES[0], LINKS[1]
    alone, two, four = (project(shape, tp, 1, link) for tp in (1, 2, 4))
    assert alone["ring_s"] == alone["pagoda_s"] == 0  # one rank: nothing to reduce
    assert two["memory_s"] == pytest.approx(alone["memory_s"] / 2) and four["memory_s"] == pytest.approx(alone["memory_s"] / 4)
    assert two["ring_s"] > two["pagoda_s"] > 0  # at TP=2 the same bytes, in half the hops
    # beyond two ranks a big buffer goes in parts: a ring's bytes and hops, in two collectives
    assert project(shape, 4, 64, link)["pagoda_s"] == pytest.approx(project(shape, 4, 64, link)["ring_s"])
    # and a small one is gathered whole: more bytes, but one switch's fixed cost instead of two
    small = project(shape, 8, 1, LINKS[0])
    assert small["pagoda_s"] < 2 * small["ring_s"]
    assert not project(SHAPES[1], 1, 1, link)["fits"] and project(SHAPES[1], 2, 1, link)["fits"]  # 70B: 141 GB


@pytest.mark.slow
def test_a_measured_tp2_step_counts_its_collectives(tmp_path, default_model_dir):
    out = tmp_path / "tp.json"
    assert main(["--sizes", "2", "--rows", "1", "--steps", "2", "--json", str(out)]) == 0
    (run,) = json.loads(out.read_text())["measured"]["sizes"]["2"]
    # 30 layers x 2 all-reduces + the embedding's, the logits gather and the plan's broadcast, every step
    assert run["calls"] == 30 * 2 + 1 + 1 + 1
    assert 0 < run["comm_s"] < run["step_s"] and run["comm_bytes"] > 0
