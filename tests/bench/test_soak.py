"""`pagoda bench soak`, short: 64 clients on the tiny model for a few seconds, every check of the report passing."""

import json

import pytest

from pagoda.bench.soak import main
from tests.server_fixtures import default_model_dir, tiny_model_dir  # noqa: F401


@pytest.mark.slow
def test_a_short_soak_keeps_the_books(tiny_model_dir, capsys):  # noqa: F811
    rc = main(["--model", str(tiny_model_dir), "--duration", "12", "--clients", "64", "--solo-sample", "16",
               "--max-running", "16", "--num-blocks", "128"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 0, report
    assert report["checks"] == {k: True for k in report["checks"]}
    assert report["by_status"].get("completed", 0) >= 32 and report["by_status"].get("hung_up", 0) > 0
    assert report["hostile"] > 0 and all(400 <= s < 500 for s in report["hostile_statuses"])
    assert report["solo_checked"] == 16 and report["health"]["samples"] > 20
    assert report["pool"]["free"] == report["pool"]["total"]


@pytest.mark.slow
def test_a_short_soak_through_the_router_keeps_every_replicas_books(tiny_model_dir, capsys):  # noqa: F811
    rc = main(["--model", str(tiny_model_dir), "--duration", "12", "--clients", "64", "--solo-sample", "8",
               "--max-running", "16", "--num-blocks", "128", "--replicas", "2", "--router-policy", "prefix"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 0, report
    assert report["checks"] == {k: True for k in report["checks"]} and report["checks"]["no_5xx"]
    assert report["by_status"].get("completed", 0) >= 32 and report["by_status"].get("hung_up", 0) > 0
    assert report["replicas"] == 2 and all(p["free"] == p["total"] for p in report["pools"])
    assert all(p["requests"] > 0 for p in report["pools"]), report["pools"]  # both replicas served the crowd
