"""`pagoda bench router-read`: a short real run against a live `pagoda router` child process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagoda.bench import router_read


def test_a_short_run_reads_prompts_and_probes_the_loop(tmp_path: Path, capsys):
    out = tmp_path / "read.json"
    assert router_read.main(["--clients", "2", "--seconds", "1.5", "--words", "200", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["prompts_read"] >= 2 and result["prompts_per_s"] > 0
    assert result["probe_ms"]["n"] >= 5 and 0 < result["probe_ms"]["p50"] <= result["probe_ms"]["max"]
    assert result["read_ms"]["n"] == result["prompts_read"]
    assert "prompts read" in capsys.readouterr().out


def test_the_arguments_are_checked():
    with pytest.raises(SystemExit):
        router_read.parse_args(["--clients", "0"])
    assert router_read.closed_port() > 0
