"""Property tests: random crowds through the real scheduler and block manager.

Every simulation audits the ledger after every step (the simulator calls
`Engine.audit()`); the properties here are about what a whole crowd leaves
behind and whether each client got exactly the tokens it would get alone.
"""

from dataclasses import replace

from hypothesis import given, note
from hypothesis import strategies as st

from pagoda.core.engine_config import EngineConfig
from pagoda.simulator.crowd import ClientPlan
from pagoda.simulator.simulate import SimulationConfig, simulate

BLOCK_SIZE = 4


@st.composite
def plans(draw, min_clients=1, max_clients=24):
    n = draw(st.integers(min_clients, max_clients))
    out = []
    for i in range(n):
        sampled = draw(st.booleans())
        out.append(
            ClientPlan(
                client_id=f"c{i}",
                arrival=draw(st.floats(0, 0.5, allow_nan=False)),
                prompt_len=draw(st.integers(1, 40)),
                max_tokens=draw(st.integers(1, 24)),
                temperature=draw(st.sampled_from([0.7, 1.0, 1.5])) if sampled else 0.0,
                top_k=draw(st.sampled_from([0, 3, 20])) if sampled else 0,
                top_p=draw(st.sampled_from([1.0, 0.8])) if sampled else 1.0,
                seed=draw(st.integers(0, 2**31 - 1)) if sampled else None,
                hangup_after=draw(st.none() | st.floats(0, 0.3, allow_nan=False)),
            )
        )
    return out


engine_configs = st.builds(
    EngineConfig,
    num_blocks=st.integers(4, 48),
    block_size=st.just(BLOCK_SIZE),
    max_running=st.integers(1, 8),
    max_batched_tokens=st.integers(8, 96),
    max_model_len=st.just(64),
)


def impossible(plan: ClientPlan, config: EngineConfig) -> bool:
    """The admission rule as the contract states it: more KV slots than the pool, or longer than the context."""
    total = plan.prompt_len + plan.max_tokens
    return -(-(total - 1) // config.block_size) > config.num_blocks or total > config.max_model_len


@given(crowd=plans(), config=engine_configs)
def test_any_crowd_leaves_a_whole_pool_and_solo_identical_answers(crowd, config):
    report = simulate(crowd, SimulationConfig(engine=config))
    note(str(report.summary()))
    assert report.audit == "ok"  # audited after every step
    assert report.pool == {"total": config.num_blocks, "free": config.num_blocks}
    assert report.matches_solo
    assert report.completed + report.hung_up + report.refused == len(crowd)
    assert report.max_steps_to_release <= 1  # a hung-up client's blocks are back within one step


@given(crowd=plans(max_clients=12), config=engine_configs)
def test_admission_refuses_exactly_the_impossible_requests(crowd, config):
    report = simulate(crowd, SimulationConfig(engine=config), check_solo=False)
    refused = {r.client_id for r in report.results if r.status == "refused"}
    assert refused == {p.client_id for p in crowd if impossible(p, config)}


@st.composite
def crowds_that_must_preempt(draw):
    """k clients in lockstep whose prompts fit together but whose full lengths do not."""
    k = draw(st.integers(2, 5))
    prompt_len = draw(st.integers(1, 12))
    max_tokens = draw(st.integers(8, 30))
    start = k * -(-prompt_len // BLOCK_SIZE)
    full = -(-(prompt_len + max_tokens - 1) // BLOCK_SIZE)
    # max_tokens >= 8 makes full > ceil(prompt_len / BLOCK_SIZE), so this range is never empty
    num_blocks = draw(st.integers(max(start, full), k * full - 1))
    crowd = [
        ClientPlan(
            client_id=f"c{i}",
            prompt_len=prompt_len,
            max_tokens=max_tokens,
            temperature=draw(st.sampled_from([0.0, 0.9])),
            seed=i,
            ignore_eos=True,
            hangup_after=None,
        )
        for i in range(k)
    ]
    return crowd, num_blocks


@given(case=crowds_that_must_preempt())
def test_preempted_clients_continue_exactly_as_alone(case):
    crowd, num_blocks = case
    config = EngineConfig(num_blocks=num_blocks, block_size=BLOCK_SIZE, max_running=8, max_batched_tokens=256, max_model_len=64)
    # without drafts the clients decode in lockstep, so the hard case really happens; with drafts (the
    # default) an accepted draft can put one client ahead and spare the preemption, and all must still hold
    plain = simulate(crowd, SimulationConfig(engine=replace(config, speculative=None)))
    note(str(plain.summary()))
    assert plain.preemptions > 0 and plain.recomputed_tokens > 0
    report = simulate(crowd, SimulationConfig(engine=config))
    note(str(report.summary()))
    for run in (plain, report):
        assert run.peak_running > 1
        assert run.completed == len(crowd) and run.matches_solo
        assert run.audit == "ok" and run.pool["free"] == num_blocks
