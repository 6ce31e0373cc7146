"""Property tests: crowds that share prefixes, through the real scheduler and block manager.

The simulator audits the ledger after every step with the prefix cache on (the
default), so a hang-up or a preemption that freed a block another request still
uses fails there. The properties here: the cache changes no client's tokens,
the pool comes back whole (truly free + cached-free == total), and the hits are
what the crowd's shape predicts.
"""

from dataclasses import replace

from hypothesis import given, note
from hypothesis import strategies as st

from pagoda.core.engine_config import EngineConfig
from pagoda.simulator.crowd import ClientPlan, agent_crowd, chat_crowd, shared_prefix_crowd
from pagoda.simulator.report import SimulationReport
from pagoda.simulator.simulate import SimulationConfig, simulate

BLOCK_SIZE = 4


@st.composite
def prefix_crowds(draw):
    """One of the three shapes (a system prompt, growing chats, agents), some clients hanging up."""
    kind, seed = draw(st.sampled_from(["shared", "chat", "agent"])), draw(st.integers(0, 2**16))
    if kind == "shared":
        plans = shared_prefix_crowd(
            seed, clients=draw(st.integers(1, 16)), system_len=draw(st.integers(1, 40)), max_question_len=8,
            arrival_gap=draw(st.floats(0, 0.1)), tenants=draw(st.integers(1, 3)),
        )
    elif kind == "chat":
        plans = chat_crowd(
            seed, chats=draw(st.integers(1, 5)), turns=draw(st.integers(1, 4)), system_len=draw(st.integers(0, 24)),
            max_turn_len=8, think_time=draw(st.floats(0, 0.1)), arrival_window=0.3,
        )
    else:
        plans = agent_crowd(
            seed, agents=draw(st.integers(1, 5)), preambles=draw(st.integers(1, 2)), preamble_len=draw(st.integers(4, 40)),
            max_task_len=6, steps=draw(st.integers(1, 3)), max_tokens=8, arrival_window=0.3,
        )
    hangups = draw(st.sets(st.sampled_from([p.client_id for p in plans]), max_size=len(plans) // 3))
    return [replace(p, hangup_after=draw(st.floats(0, 0.3))) if p.client_id in hangups else p for p in plans]


engine_configs = st.builds(
    EngineConfig,
    num_blocks=st.integers(4, 64),
    block_size=st.just(BLOCK_SIZE),
    max_running=st.integers(1, 8),
    max_batched_tokens=st.integers(8, 96),
    max_model_len=st.just(128),
)


def settled(crowd: list[ClientPlan], *reports: SimulationReport) -> set[str]:
    """Clients that completed in every run and whose predecessors did: they were sent the same prompt."""
    done = set.intersection(*({r.client_id for r in rep.results if r.status == "completed"} for rep in reports))
    out = set()
    for plan in crowd:  # predecessors come first in a crowd
        if plan.client_id in done and (plan.after is None or plan.after in out):
            out.add(plan.client_id)
    return out


@given(crowd=prefix_crowds(), config=engine_configs)
def test_the_cache_changes_no_output_and_the_pool_comes_back_whole(crowd, config):
    assert config.enable_prefix_caching  # on by default
    on = simulate(crowd, SimulationConfig(engine=config))
    off = simulate(crowd, SimulationConfig(engine=replace(config, enable_prefix_caching=False)), check_solo=False)
    note(str(on.summary()))
    assert on.audit == "ok" and off.audit == "ok"  # audited after every step
    assert on.pool == {"total": config.num_blocks, "free": config.num_blocks}  # truly free + cached-free
    assert on.matches_solo
    assert off.prefix_hit_tokens == 0
    same = settled(crowd, on, off)
    tokens_on = {r.client_id: r.output_token_ids for r in on.results if r.client_id in same}
    tokens_off = {r.client_id: r.output_token_ids for r in off.results if r.client_id in same}
    assert tokens_on == tokens_off


@given(
    clients=st.integers(2, 12),
    system_len=st.integers(1, 40),
    seed=st.integers(0, 2**16),
    max_running=st.integers(1, 8),
    max_batched_tokens=st.integers(8, 96),
)
def test_hit_tokens_are_what_one_system_prompt_predicts(clients, system_len, seed, max_running, max_batched_tokens):
    """N clients one after another with the same S-token system prompt hit >= (N-1) * floor(S / bs) * bs."""
    crowd = shared_prefix_crowd(seed, clients=clients, system_len=system_len, max_question_len=8, arrival_gap=2.0)
    enough = clients * -(-(system_len + 8 + 16) // BLOCK_SIZE)  # every client's blocks at once: nothing evicted
    config = EngineConfig(num_blocks=enough, block_size=BLOCK_SIZE, max_running=max_running,
                          max_batched_tokens=max_batched_tokens, max_model_len=128)
    report = simulate(crowd, SimulationConfig(engine=config), check_solo=False)
    note(str(report.summary()))
    assert report.completed == clients and report.audit == "ok"
    assert report.prefix_hit_tokens >= (clients - 1) * (system_len // BLOCK_SIZE) * BLOCK_SIZE


@given(clients=st.integers(2, 6), system_len=st.integers(4, 40), seed=st.integers(0, 2**16))
def test_tenants_never_hit_each_others_blocks(clients, system_len, seed):
    """The same system prompt under different tenants (or salts) is never shared."""
    base = shared_prefix_crowd(seed, clients=clients, system_len=system_len, max_question_len=8, arrival_gap=2.0)
    system = base[0].prompt[:system_len]
    crowd = [replace(p, prompt=system + p.prompt[system_len:], tenant=f"t{i}", cache_salt=f"salt{i % 2}")
             for i, p in enumerate(base)]
    config = EngineConfig(num_blocks=64, block_size=BLOCK_SIZE, max_running=4, max_batched_tokens=64, max_model_len=128)
    report = simulate(crowd, SimulationConfig(engine=config), check_solo=False)
    assert report.completed == clients and report.prefix_hit_tokens == 0
    shared = simulate([replace(p, tenant=None, cache_salt=None) for p in crowd], SimulationConfig(engine=config),
                      check_solo=False)
    assert shared.prefix_hit_tokens >= (clients - 1) * (system_len // BLOCK_SIZE) * BLOCK_SIZE


@st.composite
def sharers_that_must_preempt(draw):
    """k clients in lockstep with one system prompt, whose prompts fit together but whose full lengths do not."""
    k = draw(st.integers(2, 5))
    system = tuple(draw(st.lists(st.integers(1, 255), min_size=4, max_size=12)))
    question_len = draw(st.integers(1, 4))
    prompt_len = len(system) + question_len
    max_tokens = draw(st.integers(8, 30))
    crowd = [
        ClientPlan(client_id=f"c{i}", prompt=system + (i + 1,) * question_len, max_tokens=max_tokens, ignore_eos=True,
                   temperature=draw(st.sampled_from([0.0, 0.9])), seed=i)
        for i in range(k)
    ]
    start = k * -(-prompt_len // BLOCK_SIZE)
    full = -(-(prompt_len + max_tokens - 1) // BLOCK_SIZE)
    num_blocks = draw(st.integers(max(start, full), k * full - 1))
    return crowd, num_blocks


@given(case=sharers_that_must_preempt())
def test_preempted_and_resumed_sharers_continue_exactly_as_alone(case):
    crowd, num_blocks = case
    config = EngineConfig(num_blocks=num_blocks, block_size=BLOCK_SIZE, max_running=8, max_batched_tokens=256,
                          max_model_len=64)
    # without drafts the clients decode in lockstep, so the hard case really happens; with drafts (the
    # default) an accepted draft can put one client ahead and spare the preemption, and all must still hold
    plain = simulate(crowd, SimulationConfig(engine=replace(config, speculative=None)))
    note(str(plain.summary()))
    assert plain.preemptions > 0
    report = simulate(crowd, SimulationConfig(engine=config))
    note(str(report.summary()))
    for run in (plain, report):
        assert run.completed == len(crowd) and run.matches_solo
        assert run.audit == "ok" and run.pool["free"] == num_blocks
