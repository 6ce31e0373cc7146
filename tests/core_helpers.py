"""Small builders shared by the core unit tests."""

from pagoda.core.engine_config import EngineConfig
from pagoda.core.engine import Engine
from pagoda.simulator.fake_model import EOS_TOKEN_ID, FakeModelRunner


def fake_engine(num_blocks=16, block_size=4, max_running=4, max_batched_tokens=64, max_model_len=256,
                enable_prefix_caching=True, **kw) -> Engine:
    config = EngineConfig(
        num_blocks=num_blocks,
        block_size=block_size,
        max_running=max_running,
        max_batched_tokens=max_batched_tokens,
        max_model_len=max_model_len,
        enable_prefix_caching=enable_prefix_caching,
    )
    runner = FakeModelRunner(num_blocks, block_size, vocab_size=64, eos_bias=-50.0)  # EOS never wins
    return Engine(runner, config, eos_token_ids=(EOS_TOKEN_ID,), **kw)


def drain(engine: Engine, limit: int = 10_000) -> dict[str, list]:
    """Step until idle; returns each request's outputs. Audits after every step."""
    outputs: dict[str, list] = {}
    for _ in range(limit):
        if not engine.has_unfinished():
            return outputs
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
        engine.audit()
    raise AssertionError("engine did not drain")


def tokens(outs) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]
