"""The process's CPU set-up, decided here once for every entry point: OpenMP's wait policy and torch's threads.

Design note. torch's CPU kernels run on an OpenMP pool (GNU libgomp, which MKL and oneDNN share). Two
things about it are process-wide and are chosen here, nowhere else:

- The wait policy. Waiting OpenMP threads sleep (`OMP_WAIT_POLICY=PASSIVE`) instead of spinning: on a
  CPU shared with the HTTP thread or other processes a spinning pool keeps the cores busy and every
  parallel region then waits for a descheduled thread (measured on 2 busy cores: a decode step 227 ms
  spinning, 56 ms passive). No bounded spin (GOMP_SPINCOUNT) is set: bfloat16 decode steps at 1/16/64
  rows, 2 cores, two rounds each, measured 37-59/61-97/172-301 ms passive, 43/68/181-209 ms with
  GOMP_SPINCOUNT=1000 and 97-110/135/349-371 ms with 10000 on the quietest box we had, and with one
  `yes` busy 68-72/108-116/278-344 ms passive against 75-133/67-120/334-720 ms (spin 1000) and
  172-328/250-286/602-773 ms (spin 10000): nothing robustly better. libgomp reads the policy once,
  when it loads with torch, so `prepare_process()` must run before anything imports torch: the
  `pagoda` command does it first, the test suite in its conftest. It sets the variable, loads torch,
  and puts the environment back as it was, so a child process (a peer server a benchmark starts)
  inherits the user's environment, not pagoda's. An OMP_WAIT_POLICY the user set wins.
- The thread count. `configure_threads()` sets torch's intra-op threads once, where an engine is
  assembled (pagoda/model/factory.py, and `pagoda simulate` for its fake model, whose tensors are so
  small that one thread is fastest). The switching left inside a step (a small step on one thread but
  for its linear layers, a small attention on one thread) is the runner's (pagoda/model/runner.py), with
  the measurement that keeps it.

Library users who import torch first get the spinning default; `configure_threads` says so in the log.
No torch at import time: this module must load before torch does.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import MutableMapping
from dataclasses import dataclass

logger = logging.getLogger("pagoda.machine")

WAIT_POLICY_ENV = "OMP_WAIT_POLICY"
PASSIVE = "PASSIVE"


@dataclass
class MachineState:
    """What this process was set up with (for the log and the benchmarks' headers)."""

    wait_policy: str | None = None  # OMP_WAIT_POLICY in force when torch loaded; None = not known (torch came first)


STATE = MachineState()


def prepare_process(environ: MutableMapping[str, str] | None = None) -> MachineState:
    """Before torch is imported: load it with OpenMP's waiting threads asleep, then restore the environment."""
    environ = os.environ if environ is None else environ
    if "torch" in sys.modules:
        if STATE.wait_policy is None:
            STATE.wait_policy = environ.get(WAIT_POLICY_ENV)  # what torch saw, if the user set it; else unknown
        return STATE
    given = environ.get(WAIT_POLICY_ENV)
    environ[WAIT_POLICY_ENV] = given or PASSIVE
    try:
        import torch  # noqa: F401  (libgomp reads the policy now, once)
    finally:
        if given is None:
            del environ[WAIT_POLICY_ENV]
    STATE.wait_policy = given or PASSIVE
    return STATE


def configure_threads(threads: int | None = None) -> int:
    """torch's intra-op threads for this process (None: torch's own choice, one per physical core); the count."""
    import torch

    if STATE.wait_policy is None and os.environ.get(WAIT_POLICY_ENV) is None:
        logger.warning("torch was imported before pagoda.core.machine.prepare_process(): OpenMP threads spin while "
                       "they wait, which is slow on a shared CPU (set %s=%s, or call prepare_process() first)",
                       WAIT_POLICY_ENV, PASSIVE)
        STATE.wait_policy = "unset"  # said once
    if threads is not None and torch.get_num_threads() != threads:
        if threads < 1:
            raise ValueError(f"threads must be at least 1, got {threads}")
        torch.set_num_threads(threads)
    return torch.get_num_threads()
