"""`pagoda bench answers`: two live servers' greedy answers to the paragraph prompts, compared."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagoda.bench.answers import common_prefix, main
from tests.server_fixtures import TINY_ENGINE, TINY_NAME, start_server


@pytest.fixture(scope="module")
def twin_server(tiny_model_dir: Path):
    live = start_server(tiny_model_dir, TINY_NAME + "-twin", **TINY_ENGINE)
    try:
        yield live
    finally:
        live.server.stop()


def test_two_servers_of_one_model_answer_alike(tiny_server, twin_server, tmp_path: Path, capsys):
    out = tmp_path / "answers.json"
    assert main(["--url", tiny_server.url, "--peer-url", twin_server.url, "--output-len", "6", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["prompts"] == 16 and result["same"] == 16
    assert all(r["pagoda"] and r["pagoda"] == r["peer"] for r in result["rows"])
    assert "16/16 answers the same text" in capsys.readouterr().out and result["median_common_prefix_chars"] > 0


def test_the_common_prefix_counts_characters_until_the_first_difference():
    assert common_prefix("The cat sat", "The cab sat") == 6
    assert common_prefix("abc", "abcdef") == 3
    assert common_prefix("", "x") == 0
