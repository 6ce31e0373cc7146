"""`pagoda bench disconnect` on the default model: the bill stays within its target on every path."""

import json

import pytest

from pagoda.bench import disconnect as bench_disconnect
from pagoda.plugins.manager import registered_endpoints
from pagoda.plugins.manager import load_plugins


@pytest.mark.slow
def test_the_disconnect_bill_is_within_target_on_every_path(default_model_dir, capsys):
    # Late enough that most paths are past their prefill on a slow CPU, short enough to stay small.
    code = bench_disconnect.main(["--model", str(default_model_dir), "--device", "cpu", "--max-tokens", "400",
                                  "--hangup-after", "0.5", "--repeats", "1", "--json"])
    report = json.loads(capsys.readouterr().out)
    served = registered_endpoints(load_plugins())  # what the bench's server loads: PAGODA_PLUGINS as set here
    assert len(report["paths"]) == 2 * len(served) >= 8 and report["pool_whole"]
    assert {b["path"] for b in report["paths"]} == {e.path for e in served.values()}
    for bill in report["paths"]:
        assert bill["finish_reason"] == "abort" and bill["phase_at_close"] != "finished", bill
        # two steps of work: up to 1 + drafts tokens a step under the default speculative decoding
        steps_of_tokens = bench_disconnect.TARGET_STEPS * bill["tokens_per_step"]
        assert bill["tokens_spent"] < 400 and bill["tokens_after_close"] <= steps_of_tokens, bill
        assert bill["steps_after_close"] <= bench_disconnect.TARGET_STEPS, bill
    assert code == 0 and report["all_within_target"]
