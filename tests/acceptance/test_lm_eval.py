"""lm-evaluation-harness itself against a live server, beside its `hf` backend on the same weights.

lm-eval's `local-completions` backend, pointed at the server as a user points it (text prompts, the model's own
tokenizer for lengths), scores the 40 multiple-choice questions shipped in pagoda/bench/eval_tasks/ through
`echo` + `logprobs` requests, and generates the 12 short answers; `hf` runs the same tasks on the float32 weights
the server loaded. On the exact path (float32, no quantization) both must reach the same scores, pick the same
choice for every question, give every choice a loglikelihood within the prompt-logprob tolerance per token
(tests/model/test_hf_reference.py: 1e-4; a choice here is at most 4 tokens), and generate the same answers.
"""

import pytest

from pagoda.bench.eval import ANSWERS, MULTIPLE_CHOICE, compare, evaluate, server_args, transformers_args
from pagoda.harness.live_server import live_server
from tests.model_fixtures import default_model_dir  # noqa: F401  (a fixture used below)

pytest.importorskip("lm_eval")
TOKEN_ATOL, MAX_CHOICE_TOKENS = 1e-4, 4
TASKS = [MULTIPLE_CHOICE, ANSWERS]


@pytest.mark.slow
def test_lm_eval_scores_the_server_as_it_scores_transformers(default_model_dir):  # noqa: F811
    with live_server(default_model_dir, "smollm2", max_model_len=1024) as live:
        ours = evaluate("local-completions", server_args(live.url, live.model_name, default_model_dir), TASKS)
        live.assert_pool_whole()
        requests = live.health()["requests_total"]
    assert requests == 4 * 40 + 12  # one request per choice, one per answer: lm-eval asked this server
    theirs = evaluate("hf", transformers_args(default_model_dir), TASKS)
    report = compare(ours, theirs)
    mc, answers = report[MULTIPLE_CHOICE], report[ANSWERS]
    assert mc["questions"] == 40 and mc["same_choice"] == 40 and mc["score"] == mc["transformers"] >= 0.5, mc  # 4 choices: chance is 0.25
    assert mc["max_abs_delta"] <= TOKEN_ATOL * MAX_CHOICE_TOKENS, mc
    assert answers["questions"] == 12 and answers["same_answer"] == 12 and answers["score"] == answers["transformers"]
    assert ours[ANSWERS].answers.count("[invalid]") == 0 and answers["score"] >= 0.5, ours[ANSWERS]
