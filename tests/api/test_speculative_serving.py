"""Speculative decoding served: the same greedy text with `--speculative-config` on and off, over the official
SDK and a real socket on the default model, and its drafts counted in /health and /metrics (vLLM's names)."""

from __future__ import annotations

import pytest

from tests.helpers import metric_values
from tests.server_fixtures import start_server
from tests.server_fixtures import default_model_dir  # noqa: F401  (a fixture)

PROMPT = "one two three four one two three four one two three four one two three four one two"
ENGINE = dict(num_blocks=64, block_size=16, max_running=4, max_batched_tokens=256, max_model_len=1024)


@pytest.fixture(scope="module")
def servers(default_model_dir):  # noqa: F811
    """The default model served twice: speculation on (the default) and off."""
    on = start_server(default_model_dir, "smollm2", **ENGINE)
    try:
        off = start_server(default_model_dir, "smollm2", **ENGINE, speculative=None)
        try:
            yield on, off
        finally:
            off.server.stop()
    finally:
        on.server.stop()


@pytest.mark.slow
def test_greedy_text_is_the_same_with_and_without_drafts_and_the_drafts_are_counted(servers):
    on, off = servers
    texts = {}
    for name, live in (("on", on), ("off", off)):
        client = live.openai()
        texts[name] = [client.completions.create(model=live.model_name, prompt=PROMPT + suffix, max_tokens=40,
                                                 temperature=0).choices[0].text for suffix in ("", " one", " two")]
        streamed = client.completions.create(model=live.model_name, prompt=PROMPT, max_tokens=40, temperature=0,
                                             stream=True)
        assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == texts[name][0]
    assert texts["on"] == texts["off"]
    health, values = on.health(), metric_values(on.url)
    assert health["spec_decode_accepted_tokens_total"] > 0, "no draft was accepted: the test proved less"
    assert values["pagoda_spec_decode_draft_tokens_total"] == health["spec_decode_draft_tokens_total"]
    assert values["pagoda_spec_decode_accepted_tokens_total"] == health["spec_decode_accepted_tokens_total"]
    assert off.health()["spec_decode_draft_tokens_total"] == 0
