"""`pagoda bench disconnect` on the default model: the eight-path bill stays within its target."""

import json

import pytest

from pagoda.bench import disconnect as bench_disconnect


@pytest.mark.slow
def test_the_disconnect_bill_is_within_target_on_every_path(default_model_dir, capsys):
    # Late enough that most paths are past their prefill on a slow CPU, short enough to stay small.
    code = bench_disconnect.main(["--model", str(default_model_dir), "--device", "cpu", "--max-tokens", "400",
                                  "--hangup-after", "0.5", "--repeats", "1", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert len(report["paths"]) == 8 and report["pool_whole"]
    for bill in report["paths"]:
        assert bill["finish_reason"] == "abort" and bill["phase_at_close"] != "finished", bill
        assert bill["tokens_spent"] < 400 and bill["tokens_after_close"] <= bench_disconnect.TARGET_STEPS, bill
    assert code == 0 and report["all_within_target"]
