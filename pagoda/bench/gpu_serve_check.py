"""`pagoda serve` on a device, driven by the official openai and anthropic SDKs: a pass/fail table.

    python -m pagoda.bench.gpu_serve_check --model DIR [--device cuda] [--json PATH] [-- extra serve args]

Starts `pagoda serve --model DIR --device D --host 127.0.0.1 --port 0` as a child process and reads its ready
line for the URL. Then, each a row of the table: OpenAI completions, chat and responses, and Anthropic messages,
unary and streamed (a text must come back, and a streamed one must end with its protocol's last event); and a
disconnect: a streamed chat request of thousands of tokens (ignore_eos) is closed after a few chunks, and /health
must show within seconds that its job ended there (aborted_total up by one, nothing running or waiting, the KV
pool whole again, the generated-token counter still). The server is stopped with SIGTERM at the end.
`DIR` is a Hugging Face directory, such as the random-weight ones of `python -m pagoda.bench.gpu_model`.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import httpx

READY = re.compile(r"^pagoda serving (.*) at (http://\S+)")  # pagoda/cli/serve.py's ready line
MODEL_NAME = "random"
PROMPT = "Write a haiku about the sea."


def start(model: str, device: str, extra: Sequence[str], log_path: str, timeout: float) -> tuple[subprocess.Popen, str]:
    """The server process and its URL, once its ready line is printed (stderr goes to `log_path`)."""
    cmd = [sys.executable, "-m", "pagoda", "serve", "--model", model, "--device", device, "--host", "127.0.0.1",
           "--port", "0", "--served-model-name", MODEL_NAME, *extra]
    log = open(log_path, "w")  # noqa: SIM115  (the child's stderr, closed with the process)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env={**os.environ,
                            "PYTHONUNBUFFERED": "1"})
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            break
        if line is None:
            break
        if m := READY.match(line):
            return proc, m.group(2)
    stop(proc)
    raise RuntimeError(f"pagoda serve did not print its ready line within {timeout:.0f} s (exit {proc.poll()}); "
                       f"see {log_path}")


def stop(proc: subprocess.Popen) -> int | None:
    """SIGTERM, then SIGKILL after 30 s; the exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return proc.returncode


def checks(url: str, max_tokens: int, disconnect_tokens: int) -> dict[str, Callable[[], str]]:
    """Each check by name: returns a short description of what came back, or raises."""
    import anthropic
    import openai

    oa = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    an = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=120)
    chat = [{"role": "user", "content": PROMPT}]

    def completions() -> str:
        r = oa.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=max_tokens, temperature=0)
        return _text(r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens)

    def completions_stream() -> str:
        parts, finish = [], None
        for c in oa.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=max_tokens, temperature=0,
                                       stream=True):
            if c.choices:
                parts.append(c.choices[0].text)
                finish = c.choices[0].finish_reason or finish
        return _text("".join(parts), finish, len(parts))

    def chat_unary() -> str:
        r = oa.chat.completions.create(model=MODEL_NAME, messages=chat, max_tokens=max_tokens, temperature=0)
        return _text(r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens)

    def chat_stream() -> str:
        parts, finish = [], None
        for c in oa.chat.completions.create(model=MODEL_NAME, messages=chat, max_tokens=max_tokens, temperature=0,
                                            stream=True):
            if c.choices:
                parts.append(c.choices[0].delta.content or "")
                finish = c.choices[0].finish_reason or finish
        return _text("".join(parts), finish, len(parts))

    def responses_unary() -> str:
        r = oa.responses.create(model=MODEL_NAME, input=PROMPT, max_output_tokens=max_tokens, temperature=0)
        return _text(r.output_text, r.status, r.usage.output_tokens)

    def responses_stream() -> str:
        parts, last = [], None
        for event in oa.responses.create(model=MODEL_NAME, input=PROMPT, max_output_tokens=max_tokens,
                                         temperature=0, stream=True):
            if event.type == "response.output_text.delta":
                parts.append(event.delta)
            last = event.type
        if last not in ("response.completed", "response.incomplete"):
            raise AssertionError(f"the stream ended with {last!r}, not response.completed/incomplete")
        return _text("".join(parts), last, len(parts))

    def messages_unary() -> str:
        r = an.messages.create(model=MODEL_NAME, max_tokens=max_tokens, messages=chat)
        return _text("".join(b.text for b in r.content if b.type == "text"), r.stop_reason, r.usage.output_tokens)

    def messages_stream() -> str:
        with an.messages.stream(model=MODEL_NAME, max_tokens=max_tokens, messages=chat) as s:
            text = "".join(s.text_stream)
            final = s.get_final_message()
        return _text(text, final.stop_reason, final.usage.output_tokens)

    return {
        "openai completions": completions, "openai completions, stream": completions_stream,
        "openai chat": chat_unary, "openai chat, stream": chat_stream,
        "openai responses": responses_unary, "openai responses, stream": responses_stream,
        "anthropic messages": messages_unary, "anthropic messages, stream": messages_stream,
        "disconnect ends the job": lambda: disconnect(url, max_tokens=disconnect_tokens),
    }


def _text(text: str | None, finish: Any, tokens: Any) -> str:
    if not text:
        raise AssertionError(f"no text came back (finish {finish!r}, {tokens} tokens)")
    return f"{len(text)} chars, {tokens} tokens/chunks, finish {finish}: {text[:40]!r}"


def health(url: str) -> dict[str, Any]:
    return httpx.get(f"{url}/health", timeout=30).json()


def disconnect(url: str, chunks: int = 5, max_tokens: int = 4000) -> str:
    """A long streamed chat request closed after a few chunks: its job must end and its blocks return."""
    before = health(url)
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "ignore_eos": True}
    seen = 0
    with httpx.Client(base_url=url, timeout=60) as client, client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise AssertionError(f"HTTP {r.status_code}: {r.read().decode(errors='replace')[:200]}")
        for line in r.iter_lines():
            seen += line.startswith("data:")
            if seen >= chunks:
                break
    closed = time.monotonic()  # the response and its connection are closed here
    deadline, last, h = closed + 20, None, before
    while time.monotonic() < deadline:
        h = health(url)
        idle = h["running"] == 0 and h["waiting"] == 0 and h["kv_blocks_free"] == h["kv_blocks_total"]
        if idle and h["aborted_total"] == before["aborted_total"] + 1 and last == h["generated_tokens_total"]:
            generated = h["generated_tokens_total"] - before["generated_tokens_total"]
            return (f"ended {time.monotonic() - closed:.2f} s after the close, {generated} of {max_tokens} tokens "
                    f"generated, pool {h['kv_blocks_free']}/{h['kv_blocks_total']} free")
        last = h["generated_tokens_total"]
        time.sleep(0.2)
    raise AssertionError(f"20 s after the close the job had not ended: before {_counts(before)}, now {_counts(h)}")


def _counts(h: dict[str, Any]) -> dict[str, Any]:
    keys = ("running", "waiting", "kv_blocks_free", "kv_blocks_total", "aborted_total", "generated_tokens_total")
    return {k: h.get(k) for k in keys}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Start the server, run every check, stop it; the results."""
    started = time.monotonic()
    result: dict[str, Any] = {"device": args.device, "model": args.model, "checks": []}
    try:
        proc, url = start(args.model, args.device, args.serve_args, args.log, args.start_timeout)
    except Exception as exc:  # noqa: BLE001  (reported as the first row)
        result["checks"].append({"name": "server starts", "ok": False, "detail": str(exc), "seconds": 0.0})
        return result
    result["checks"].append({"name": "server starts", "ok": True, "detail": url,
                             "seconds": round(time.monotonic() - started, 2)})
    try:
        h = health(url)
        result["health"] = {k: v for k, v in h.items() if not isinstance(v, (dict, list))}
        for name, check in checks(url, args.max_tokens, args.disconnect_tokens).items():
            t0 = time.monotonic()
            try:
                detail, ok = check(), True
            except Exception as exc:  # noqa: BLE001  (one row fails, the others still run)
                detail, ok = f"{type(exc).__name__}: {exc}"[:300], False
            row = {"name": name, "ok": ok, "detail": detail, "seconds": round(time.monotonic() - t0, 2)}
            result["checks"].append(row)
            print(f"  {'PASS' if ok else 'FAIL'} {name} ({row['seconds']} s): {detail}", flush=True)
    finally:
        code = stop(proc)
        result["checks"].append({"name": "SIGTERM stops the server", "ok": code == 0, "detail": f"exit {code}",
                                 "seconds": 0.0})
    return result


def table(result: dict[str, Any]) -> str:
    lines = [f"`pagoda serve --device {result['device']}` on {result['model']}", "",
             "| check | result | seconds | detail |", "|---|---|---:|---|"]
    for c in result["checks"]:
        detail = str(c["detail"]).replace("|", "/").replace("\n", " ")
        lines.append(f"| {c['name']} | {'pass' if c['ok'] else '**FAIL**'} | {c['seconds']} | {detail} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pagoda.bench.gpu_serve_check", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="a Hugging Face directory")
    p.add_argument("--device", default="cuda")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--disconnect-tokens", type=int, default=4000,
                   help="the closed request's max_tokens: more than it can make before the close is seen")
    p.add_argument("--start-timeout", type=float, default=180.0)
    p.add_argument("--log", default="/tmp/pagoda_serve_check.log", help="the server's stderr")
    p.add_argument("--json", default=None)
    p.add_argument("serve_args", nargs="*", help="more `pagoda serve` arguments (after --)")
    args = p.parse_args(argv)
    # a time limit's SIGTERM unwinds through run()'s `finally`, which stops the server
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    result = run(args)
    print(table(result), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if all(c["ok"] for c in result["checks"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
