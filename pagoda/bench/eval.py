"""`pagoda bench eval`: lm-evaluation-harness against pagoda's server, beside transformers on the same weights.

A served model is checked the way a checkpoint is: lm-eval's `local-completions` backend sends its
loglikelihood requests (`echo` with `logprobs`, `max_tokens` 1) and its generate requests to
/v1/completions, and the same tasks run through lm-eval's `hf` backend on the weights the server loaded
(transformers, float32). Two small tasks ship with pagoda (pagoda/bench/eval_tasks/): 40 multiple-choice
questions (`output_type: multiple_choice`: accuracy by loglikelihood) and 12 short answers
(`generate_until`: exact match of a greedy answer).

For every weight format asked, a live server on the default model answers lm-eval; the report gives each
task's score, its difference from transformers', and per question how far each choice's loglikelihood lies
from transformers' (max and mean |delta|) and whether the same choice wins. JSON on stdout (or --out), a
markdown table on stderr.

    pagoda bench eval                                  # float32, bfloat16, int8, int4 and gguf
    pagoda bench eval --formats float32 --limit 10
    pagoda bench eval --url http://127.0.0.1:8000 --model-name default   # any running OpenAI-compatible server
    pagoda bench eval --write-tasks tasks/             # the task files, for `lm-eval --include_path tasks/`
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

TASKS_DIR = Path(__file__).with_name("eval_tasks")
MULTIPLE_CHOICE, ANSWERS = "pagoda_mc", "pagoda_answers"
# the lm-eval task files: each reads its questions from pagoda/bench/eval_tasks/ (an absolute path, written out)
_TASK_YAML = {
    MULTIPLE_CHOICE: """task: pagoda_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}/questions.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: " "
metric_list:
  - metric: acc
""",
    ANSWERS: """task: pagoda_answers
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}/answers.jsonl
test_split: test
output_type: generate_until
description: "Question: What is the capital of Peru?\\nAnswer: Lima\\n\\nQuestion: What color is snow?\\nAnswer: White\\n\\n"
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n", "."]
  max_gen_toks: 8
  do_sample: false
  temperature: 0
filter_list:
  - name: strip
    filter:
      - function: regex
        regex_pattern: "([A-Za-z]+)"
      - function: take_first
metric_list:
  - metric: exact_match
    ignore_case: true
    ignore_punctuation: true
""",
}
SCORES = {MULTIPLE_CHOICE: "acc", ANSWERS: "exact_match"}
# name -> (dtype, quantization) of a served format
FORMATS = {"float32": ("float32", "none"), "bfloat16": ("bfloat16", "none"), "int8": ("float32", "int8"),
           "int4": ("float32", "int4"), "gguf": ("float32", "gguf")}


@dataclass
class TaskResult:
    """One task through one backend: its score, and per question what lm-eval kept."""

    score: float
    loglikelihoods: list[list[float]] = field(default_factory=list)  # per question, per choice (multiple choice)
    answers: list[str] = field(default_factory=list)  # per question, the filtered answer (generate)


def write_tasks(folder: Path) -> Path:
    """The shipped tasks as lm-eval task files in `folder`, reading the questions where they lie."""
    for name, text in _TASK_YAML.items():
        (folder / f"{name}.yaml").write_text(text.format(data=TASKS_DIR.resolve()))
    return folder


def evaluate(model: str, model_args: dict[str, Any], tasks: list[str], *, limit: int | None = None
             ) -> dict[str, TaskResult]:
    """lm-eval's own `simple_evaluate` on the shipped tasks through one backend (`local-completions`, `hf`)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    with tempfile.TemporaryDirectory() as folder, _offline():
        manager = TaskManager(include_path=str(write_tasks(Path(folder))))
        out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=tasks, task_manager=manager,
                                      batch_size=1, limit=limit, log_samples=True, bootstrap_iters=0)
    results = {}
    for task in tasks:
        samples = sorted(out["samples"][task], key=lambda s: s["doc_id"])
        metric = next(k for k in out["results"][task] if k.split(",")[0] == SCORES[task])  # "name,filter"
        result = TaskResult(score=float(out["results"][task][metric]))
        if task == MULTIPLE_CHOICE:
            result.loglikelihoods = [[float(r[0]) for r in s["filtered_resps"]] for s in samples]
        else:
            result.answers = [str(s["filtered_resps"][0]) for s in samples]
        results[task] = result
    return results


def server_args(url: str, model_name: str, tokenizer: str | Path) -> dict[str, Any]:
    """`local-completions` as a user points it at a server: text prompts, the model's own tokenizer for lengths."""
    return {"base_url": f"{url.rstrip('/')}/v1/completions", "model": model_name, "tokenizer": str(tokenizer),
            "tokenizer_backend": "huggingface", "tokenized_requests": False, "num_concurrent": 1, "max_retries": 1}


def transformers_args(model_dir: str | Path) -> dict[str, Any]:
    return {"pretrained": str(model_dir), "dtype": "float32", "device": "cpu"}


def compare(ours: dict[str, TaskResult], theirs: dict[str, TaskResult]) -> dict[str, Any]:
    """Per task: both scores and their difference; loglikelihood deltas per choice; questions answered alike."""
    report: dict[str, Any] = {}
    for task, mine in ours.items():
        ref = theirs[task]
        row: dict[str, Any] = {"score": mine.score, "transformers": ref.score, "difference": mine.score - ref.score}
        if task == MULTIPLE_CHOICE:
            deltas = [abs(a - b) for q, r in zip(mine.loglikelihoods, ref.loglikelihoods) for a, b in zip(q, r)]
            row.update(max_abs_delta=max(deltas), mean_abs_delta=sum(deltas) / len(deltas),
                       same_choice=sum(_argmax(q) == _argmax(r) for q, r in zip(mine.loglikelihoods,
                                                                                 ref.loglikelihoods)),
                       questions=len(mine.loglikelihoods))
        else:
            row.update(same_answer=sum(a == b for a, b in zip(mine.answers, ref.answers)), questions=len(mine.answers))
        report[task] = row
    return report


def _argmax(values: list[float]) -> int:
    return max(range(len(values)), key=values.__getitem__)


@contextlib.contextmanager
def _offline() -> Iterator[None]:
    """Nothing is fetched: the tasks read local files, the tokenizer and weights are local directories."""
    saved = {k: os.environ.get(k) for k in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TOKENIZERS_PARALLELISM")}
    os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def markdown(report: dict[str, Any]) -> str:
    lines = ["| format | task | pagoda | transformers | difference | loglikelihood max / mean abs delta | same |",
             "|---|---|---|---|---|---|---|"]
    for name, tasks in report["formats"].items():
        for task, row in tasks.items():
            deltas = (f"{row['max_abs_delta']:.2e} / {row['mean_abs_delta']:.2e}" if "max_abs_delta" in row else "")
            same = row.get("same_choice", row.get("same_answer"))
            lines.append(f"| {name} | {task} | {row['score']:.3f} | {row['transformers']:.3f} | "
                         f"{row['difference']:+.3f} | {deltas} | {same}/{row['questions']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pagoda bench eval", description=__doc__.split("\n\n")[0])
    p.add_argument("--formats", default=",".join(FORMATS), help=f"served weight formats, of {', '.join(FORMATS)}")
    p.add_argument("--model", default="default", help="the model every format serves, and transformers loads")
    p.add_argument("--url", help="evaluate this running server instead (its --model-name model, --model's weights"
                                 " for transformers)")
    p.add_argument("--model-name", default="default", help="the model name to ask the --url server for")
    p.add_argument("--tasks", default=f"{MULTIPLE_CHOICE},{ANSWERS}")
    p.add_argument("--limit", type=int, help="the first N questions of each task")
    p.add_argument("--out", type=Path, help="write the JSON report here (else stdout)")
    p.add_argument("--write-tasks", type=Path, metavar="DIR",
                   help="only write the task files into DIR, for lm-eval's own command (--include_path DIR)")
    args = p.parse_args(argv)
    if args.write_tasks:
        args.write_tasks.mkdir(parents=True, exist_ok=True)
        print(write_tasks(args.write_tasks))
        return 0
    logging.getLogger("lm-eval").setLevel(logging.WARNING)

    from pagoda.core.machine import cpu_facts
    from pagoda.model.hub import resolve_model

    model_dir = resolve_model(args.model, progress=False)
    tasks = args.tasks.split(",")
    theirs = evaluate("hf", transformers_args(model_dir), tasks, limit=args.limit)
    report: dict[str, Any] = {"cpu": cpu_facts().describe(), "model": args.model,
                              "transformers": {t: asdict(r) for t, r in theirs.items()}, "formats": {}}
    if args.url:
        report["formats"]["server"] = compare(
            evaluate("local-completions", server_args(args.url, args.model_name, model_dir), tasks, limit=args.limit),
            theirs)
    else:
        from pagoda.harness.live_server import live_server

        for name in args.formats.split(","):
            dtype, quantization = FORMATS[name]
            with live_server(model_dir, "default", dtype=dtype, quantization=quantization) as live:
                ours = evaluate("local-completions", server_args(live.url, live.model_name, model_dir), tasks,
                                limit=args.limit)
                live.assert_pool_whole()
            report["formats"][name] = compare(ours, theirs)
            print(f"{name}: {json.dumps(report['formats'][name])}", file=sys.stderr, flush=True)
    text = json.dumps(report, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    else:
        print(text)
    print(markdown(report), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
