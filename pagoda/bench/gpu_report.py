"""The GPU check's report: its sections' outputs gathered into summary.md and results.json.

    python -m pagoda.bench.gpu_report PARTS_DIR OUT_DIR

`pagoda/bench/gpu_check.sh` runs each section with its output in PARTS_DIR/NAME.out (and any JSON it writes in
PARTS_DIR/NAME.json), one status line per section in PARTS_DIR/status.tsv (name, exit status, seconds), and the
machine's description in PARTS_DIR/env.out; after every section it calls this, so a run cut short still leaves
what it measured. summary.md: the machine, a status table, then each section's tables and failures (a short
output whole); results.json: every section's JSON by name, with the statuses.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

KEEP = re.compile(r"^\s*\|.*\||FAILED|ERROR|Error|Traceback|passed|failed|skipped|PASS|FAIL|tokens/s|^model |^device ")
SHORT = 60  # an output of at most this many lines goes into the summary whole


def excerpt(text: str) -> str:
    """A section's output for the summary: whole when short, else its head, tables, failures and tail."""
    lines = text.rstrip("\n").splitlines()
    if len(lines) <= SHORT:
        return "\n".join(lines)
    head, tail = lines[:8], lines[-20:]
    middle = [line for line in lines[8:-20] if KEEP.search(line)]
    return "\n".join(head + ["[...]"] + middle[-150:] + ["[...]"] + tail)


def status_rows(parts: Path) -> list[dict]:
    path = parts / "status.tsv"
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        name, rc, seconds = (line.split("\t") + ["", ""])[:3]
        rows.append({"section": name, "exit": rc, "seconds": seconds})
    return rows


def build(parts: Path, out: Path) -> None:
    statuses = status_rows(parts)
    env = (parts / "env.out").read_text() if (parts / "env.out").is_file() else ""
    lines = ["# pagoda GPU check", "", "```", env.strip(), "```", "", "| section | result | seconds |", "|---|---|---:|"]
    for s in statuses:
        result = {"0": "ok", "124": "**timed out**", "137": "**killed**", "skipped": "skipped"}.get(
            s["exit"], f"**exit {s['exit']}**")
        lines.append(f"| {s['section']} | {result} | {s['seconds']} |")
    results: dict = {"status": statuses}
    for s in statuses:
        name = s["section"]
        output = parts / f"{name}.out"
        if output.is_file():
            lines += ["", f"## {name}", "", "```", excerpt(output.read_text(errors="replace")), "```"]
        data = parts / f"{name}.json"
        if data.is_file():
            try:
                results[name] = json.loads(data.read_text())
            except ValueError as exc:
                results[name] = {"unreadable": str(exc)}
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    (out / "results.json").write_text(json.dumps(results, indent=1))


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    build(Path(args[0]), Path(args[1]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
