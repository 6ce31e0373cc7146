"""`pagoda bench answers`: pagoda's greedy chat answers against a peer's on the same prompts and model file.

    pagoda bench answers --peer-url URL [--peer-command CMD] [--url URL] [--output-len 64] [--json FILE]

Without --url it starts `pagoda serve` on the default model with its defaults (a GGUF's own blocks on a CPU);
--peer-command starts the peer (llama.cpp's llama-server on the same GGUF). Every paragraph prompt of
`pagoda bench serve` goes to both servers one at a time, greedy, `--output-len` tokens at most; the report
counts the answers that are the same text, and for the others how far they agree (the common prefix, in
characters, of each pair). Two servers multiplying the same blocks with the same arithmetic answer alike; a
format that rounds differently drifts apart after some tokens.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from contextlib import ExitStack

import httpx

from pagoda.bench.serve.peer import peer_process
from pagoda.bench.serve.server import pagoda_subprocess, serve_command
from pagoda.bench.serve.workloads import paragraphs


def model_id(http: httpx.Client, url: str) -> str:
    """The server's first /v1/models id (what a request names)."""
    response = http.get(f"{url.rstrip('/')}/v1/models")
    response.raise_for_status()
    return response.json()["data"][0]["id"]


def answer(http: httpx.Client, url: str, model: str, prompt: str, output_len: int) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "temperature": 0.0,
            "max_tokens": output_len}
    response = http.post(f"{url.rstrip('/')}/v1/chat/completions", json=body)
    response.raise_for_status()
    return response.json()["choices"][0]["message"]["content"]


def common_prefix(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def compare(url: str, peer_url: str, output_len: int) -> dict:
    """Both servers' answers to every paragraph prompt, and how they agree."""
    rows = []
    with httpx.Client(timeout=300.0, trust_env=False) as http:
        model, peer_model = model_id(http, url), model_id(http, peer_url)
        for prompt in paragraphs(output_len):
            ours = answer(http, url, model, prompt.text, output_len)
            theirs = answer(http, peer_url, peer_model, prompt.text, output_len)
            rows.append({"prompt": prompt.text, "pagoda": ours, "peer": theirs, "same": ours == theirs,
                         "common_prefix_chars": common_prefix(ours, theirs)})
    same = sum(r["same"] for r in rows)
    prefix = sorted(r["common_prefix_chars"] for r in rows)
    return {"prompts": len(rows), "same": same, "median_common_prefix_chars": prefix[len(prefix) // 2], "rows": rows}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pagoda bench answers", description=__doc__.split("\n")[0])
    ap.add_argument("--url", help="a running pagoda (default: start one here on --model with its defaults)")
    ap.add_argument("--model", default="default")
    ap.add_argument("--server-arg", action="append", default=[], metavar="ARG", help="another `pagoda serve` argument")
    ap.add_argument("--peer-url", required=True)
    ap.add_argument("--peer-command", help="start the peer with this command line (it must listen at --peer-url)")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--ready-timeout", type=float, default=300.0)
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args(argv)
    with ExitStack() as stack:
        url = args.url or stack.enter_context(pagoda_subprocess(serve_command(args.model, extra=args.server_arg),
                                                                args.ready_timeout))
        peer = args.peer_url
        if args.peer_command:
            stack.enter_context(peer_process(args.peer_command, peer, args.ready_timeout))
        result = compare(url, peer, args.output_len)
    for row in result["rows"]:
        mark = "same" if row["same"] else f"differs after {row['common_prefix_chars']} chars"
        print(f"{mark:>24}  {row['prompt']}")
    print(f"{result['same']}/{result['prompts']} answers the same text; the answers agree for a median "
          f"{result['median_common_prefix_chars']} characters")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0
