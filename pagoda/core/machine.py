"""Every pagoda process's CPU set-up, decided here once: OpenMP's wait policy and torch's threads.

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
  and puts the environment back as it was (`environ_defaults`), so a child process (a peer server a
  benchmark starts) inherits the user's environment, not pagoda's. A process spawned by
  multiprocessing loads torch before any pagoda code runs in it (unpickling its arguments), so its
  parent starts it inside `children_wait_passive()`. An OMP_WAIT_POLICY the user set wins.
- The thread count, by the kind of process:
  - a server, the library, a benchmark: `configure_threads()` once, where an engine is assembled
    (pagoda/model/factory.py): torch's own count, one per physical core (`pagoda simulate` asks for
    one thread: its fake model's tensors are so small that one thread is fastest);
  - a tensor-parallel rank (pagoda/model/ranks.py): `threads_per_process(ranks on this machine)`,
    its even share; rank 0 works out the share of the ranks it spawns and each sets it on itself;
  - a data-parallel replica (pagoda/cli/data_parallel.py): `threads_per_process(replicas)`, handed to
    it in its environment (`threads_environ`: OMP_NUM_THREADS, read when torch loads in it), unless the
    user set OMP_NUM_THREADS, which every replica then gets.
  The switching left inside a step (a small step on one thread but for its linear layers, a small
  attention on one thread) is the runner's decision (pagoda/model/runner.py, with the measurement that
  keeps it), made through `set_threads`.

Library users who import torch first get the spinning default; `configure_threads` says so in the log.
No torch at import time: this module must load before torch does.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Iterator, Mapping, MutableMapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass

logger = logging.getLogger("pagoda.machine")

WAIT_POLICY_ENV = "OMP_WAIT_POLICY"
PASSIVE = "PASSIVE"
THREADS_ENV = "OMP_NUM_THREADS"  # OpenMP's thread count, read when torch loads: how a child starts on its share


@dataclass
class MachineState:
    """What this process was set up with (for the log and the benchmarks' headers)."""

    wait_policy: str | None = None  # OMP_WAIT_POLICY in force when torch loaded; None = not known (torch came first)


STATE = MachineState()


@contextmanager
def environ_defaults(values: Mapping[str, str], environ: MutableMapping[str, str] | None = None) -> Iterator[None]:
    """For the length of a `with`, each of `values` the user left unset (or empty) set; after, the environment back.

    For a setting read once, when something loads or is made (OpenMP's policy when torch loads, NCCL's blocking
    wait when a process group is made): set for that moment only, so that the process's children, started later,
    inherit the user's environment, not pagoda's."""
    environ = os.environ if environ is None else environ
    replaced = {name: environ.get(name) for name in values if not environ.get(name)}
    for name in replaced:
        environ[name] = values[name]
    try:
        yield
    finally:
        for name, before in replaced.items():
            if before is None:
                environ.pop(name, None)
            else:
                environ[name] = before


def prepare_process(environ: MutableMapping[str, str] | None = None) -> MachineState:
    """Before torch is imported: load it with OpenMP's waiting threads asleep, then restore the environment."""
    environ = os.environ if environ is None else environ
    if "torch" in sys.modules:
        if STATE.wait_policy is None:
            STATE.wait_policy = environ.get(WAIT_POLICY_ENV)  # what torch saw, if the user set it; else unknown
        return STATE
    given = environ.get(WAIT_POLICY_ENV)
    with environ_defaults({WAIT_POLICY_ENV: PASSIVE}, environ):
        import torch  # noqa: F401  (libgomp reads the policy now, once)
    STATE.wait_policy = given or PASSIVE
    return STATE


def children_wait_passive() -> AbstractContextManager[None]:
    """For the length of a `with`: processes started now (multiprocessing's spawn, which loads torch before any
    pagoda code runs in the child) get OpenMP's sleeping wait policy, unless the user set one."""
    return environ_defaults({WAIT_POLICY_ENV: PASSIVE})


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
        set_threads(threads)
    return torch.get_num_threads()


def set_threads(threads: int) -> None:
    """torch's intra-op threads from now on, where they differ: `configure_threads`' setting, and the runner's
    switches inside a step, each of which puts the process's count back when its part of the step ends."""
    import torch

    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def threads_per_process(processes: int) -> int:
    """Each process's torch threads when `processes` of them split this machine (the tensor-parallel ranks on it,
    or the data-parallel replicas): this process's count (one per physical core, unless the user chose) split
    evenly, at least one each."""
    import torch

    if processes < 1:
        raise ValueError(f"processes must be at least 1, got {processes}")
    return max(1, torch.get_num_threads() // processes)


def threads_environ(threads: int, inherited: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables that start a child process on `threads` torch threads (OpenMP reads them when torch loads in
    it); none when the environment it inherits, `inherited`, names a count already: the user's wins."""
    if inherited is not None and inherited.get(THREADS_ENV):
        return {}
    return {THREADS_ENV: str(threads)}


# The x86 ISA extensions that decide which kernels run (/proc/cpuinfo's flag -> the name we print)
ISA_FLAGS = {"avx2": "AVX2", "fma": "FMA", "avx512f": "AVX-512", "avx512_vnni": "AVX512-VNNI",
             "avx_vnni": "AVX-VNNI", "avx512_bf16": "AVX512-BF16", "avx512_fp16": "AVX512-FP16",
             "amx_bf16": "AMX-BF16", "amx_int8": "AMX-INT8"}
ONEDNN_ISA_ENV = "ONEDNN_MAX_CPU_ISA"  # oneDNN's cap on the instructions its kernels use, read when torch loads


@dataclass(frozen=True)
class CpuFacts:
    """The CPU this process runs on, as every figure and /health names it."""

    model: str  # /proc/cpuinfo's model name (platform.processor() where there is none)
    flags: frozenset[str]  # every flag /proc/cpuinfo lists
    cores: int  # the cores this process may run on

    @property
    def isa(self) -> list[str]:
        """The kernel-deciding ISA extensions present, by our names (ISA_FLAGS), in that order."""
        return [name for flag, name in ISA_FLAGS.items() if flag in self.flags]

    def describe(self) -> dict[str, object]:
        """For JSON: the model, its ISA extensions, the cores, and oneDNN's ISA cap when one is set."""
        return {"cpu": self.model, "isa": self.isa, "cores": self.cores,
                "onednn_max_cpu_isa": os.environ.get(ONEDNN_ISA_ENV)}


def cpu_facts(cpuinfo: str | None = None) -> CpuFacts:
    """Read this machine's CPU (from `cpuinfo`'s text when given, else /proc/cpuinfo)."""
    import platform

    if cpuinfo is None:
        cpuinfo = _proc_cpuinfo()
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() not in fields:  # the first processor's
            fields[key.strip()] = value.strip()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return CpuFacts(model=fields.get("model name") or platform.processor() or platform.machine(),
                    flags=frozenset(fields.get("flags", "").split()), cores=cores)


@functools.cache
def _proc_cpuinfo() -> str:
    """/proc/cpuinfo's text, read once a process ("" where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""
