"""The model's generation_config.json sampling defaults for the fields a request leaves null (--generation-config)."""

import json
import shutil

import httpx
import pytest

from pagoda.api.settings import ServeSettings
from pagoda.model.factory import generation_defaults
from tests.server_fixtures import TINY_ENGINE, default_model_dir, start_server, tiny_model_dir  # noqa: F401

PROMPT = "A pagoda stands by the river"


@pytest.fixture(scope="module")
def greedy_by_default(tiny_model_dir, tmp_path_factory):  # noqa: F811
    model_dir = tmp_path_factory.mktemp("greedy_model")
    shutil.copytree(tiny_model_dir, model_dir, dirs_exist_ok=True)
    (model_dir / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "temperature": 0.0,
                                                                  "top_p": 0.9, "do_sample": True}))
    settings = ServeSettings(generation_defaults=generation_defaults(model_dir))
    live = start_server(model_dir, "m", settings=settings, **TINY_ENGINE)
    try:
        yield live
    finally:
        live.server.stop()


def test_generation_defaults_keep_only_the_sampling_keys(tmp_path):
    assert generation_defaults(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_k": 20, "eos_token_id": 2,
                                                                 "top_p": True, "max_new_tokens": 9}))
    assert generation_defaults(tmp_path) == {"temperature": 0.6, "top_k": 20}


def _text(live, path, body):
    r = httpx.post(f"{live.url}{path}", json=body, timeout=60)
    assert r.status_code == 200, r.text
    data = r.json()
    return data["choices"][0]["text"] if "choices" in data else data["content"][0]["text"]


def test_a_request_that_omits_temperature_gets_the_models_default(greedy_by_default):
    live = greedy_by_default
    base = {"model": "m", "prompt": PROMPT, "max_tokens": 24, "ignore_eos": True}
    greedy = _text(live, "/v1/completions", {**base, "temperature": 0})
    # temperature omitted: the model's 0.0, so the seed does not matter
    assert {_text(live, "/v1/completions", {**base, "seed": s}) for s in (1, 2, 3)} == {greedy}
    messages = {"model": "m", "max_tokens": 24, "messages": [{"role": "user", "content": PROMPT}], "ignore_eos": True}
    assert _text(live, "/v1/messages", {**messages, "seed": 5}) == _text(live, "/v1/messages", {**messages, "seed": 6})
    # a temperature the request names wins over the model's
    flat = {_text(live, "/v1/completions", {**base, "temperature": 2.0, "seed": s}) for s in (1, 2, 3)}
    assert flat != {greedy}
