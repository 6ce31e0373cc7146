"""A simulated crowd with n-gram drafts in the fake model's padded rows: audited after every step, every
completed client identical to its solo run, and drafts both kept and rejected along the way."""

from __future__ import annotations

import dataclasses

from pagoda.simulator.crowd import mixed_crowd
from pagoda.simulator.simulate import SimulationConfig, simulate


def test_a_crowd_with_drafts_matches_its_solo_runs_and_the_crowd_without_drafts():
    crowd = mixed_crowd(3, clients=40)
    report = simulate(crowd)
    assert report.ok and report.completed > 0
    assert report.accepted_tokens > 0 and report.draft_tokens > report.accepted_tokens
    config = SimulationConfig()
    off = simulate(crowd, dataclasses.replace(config, engine=dataclasses.replace(config.engine, speculative=None)),
                   check_solo=False)
    assert off.draft_tokens == 0
    done_off = {r.client_id: r.output_token_ids for r in off.results if r.status == "completed"}
    both = [r for r in report.results if r.status == "completed" and r.client_id in done_off]
    assert len(both) > 10 and all(r.output_token_ids == done_off[r.client_id] for r in both)
