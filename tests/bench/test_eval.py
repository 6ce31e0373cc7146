"""`pagoda bench eval`: its task files and its comparison (the run itself: tests/acceptance/test_lm_eval.py)."""

from __future__ import annotations

import json

import pytest

from pagoda.bench.eval import ANSWERS, MULTIPLE_CHOICE, TASKS_DIR, TaskResult, compare, main, markdown


def test_write_tasks_gives_lm_eval_task_files_reading_the_shipped_questions(tmp_path, capsys):
    yaml = pytest.importorskip("yaml")
    assert main(["--write-tasks", str(tmp_path)]) == 0
    configs = {p.stem: yaml.safe_load(p.read_text()) for p in tmp_path.glob("*.yaml")}
    assert set(configs) == {MULTIPLE_CHOICE, ANSWERS}
    assert configs[MULTIPLE_CHOICE]["output_type"] == "multiple_choice"
    assert configs[ANSWERS]["output_type"] == "generate_until"
    for config, lines in ((configs[MULTIPLE_CHOICE], 40), (configs[ANSWERS], 12)):
        data = config["dataset_kwargs"]["data_files"]["test"]
        assert data.startswith(str(TASKS_DIR.resolve()))
        rows = [json.loads(line) for line in open(data)]
        assert len(rows) == lines and all(row["question"] for row in rows)
    assert all(0 <= row["answer"] < len(row["choices"]) == 4
               for row in map(json.loads, open(TASKS_DIR / "questions.jsonl")))


def test_compare_reports_scores_deltas_and_agreement():
    ours = {MULTIPLE_CHOICE: TaskResult(0.5, loglikelihoods=[[-1.0, -2.0], [-3.0, -1.5]]),
            ANSWERS: TaskResult(1.0, answers=["Paris", "Rome"])}
    theirs = {MULTIPLE_CHOICE: TaskResult(1.0, loglikelihoods=[[-1.1, -2.0], [-1.0, -1.5]]),
              ANSWERS: TaskResult(0.5, answers=["Paris", "Oslo"])}
    report = compare(ours, theirs)
    mc = report[MULTIPLE_CHOICE]
    assert mc["difference"] == -0.5 and mc["same_choice"] == 1 and mc["questions"] == 2
    assert mc["max_abs_delta"] == pytest.approx(2.0) and mc["mean_abs_delta"] == pytest.approx(0.525)
    assert report[ANSWERS]["same_answer"] == 1 and report[ANSWERS]["difference"] == 0.5
    table = markdown({"formats": {"float32": report}})
    assert "| float32 | pagoda_mc | 0.500 | 1.000 | -0.500 | 2.00e+00 / 5.25e-01 | 1/2 |" in table
