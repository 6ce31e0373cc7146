"""The process's CPU set-up: one place, before torch loads, and nothing left in a child's environment."""

import json
import os
import subprocess
import sys

PROBE = """
import json, os, sys
from pagoda.core import machine
before = "torch" in sys.modules
state = machine.prepare_process()
import torch
print(json.dumps({"torch_before": before, "policy": state.wait_policy, "env": os.environ.get("OMP_WAIT_POLICY"),
                  "threads": machine.configure_threads(1), "torch_threads": torch.get_num_threads()}))
"""


def probe(env: dict[str, str]) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_torch_loads_with_sleeping_openmp_threads_and_the_environment_is_left_as_it_was():
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    seen = probe(env)
    assert seen["torch_before"] is False  # importing the module loads no torch
    assert seen["policy"] == "PASSIVE"  # what libgomp read when torch loaded
    assert seen["env"] is None  # a child started now inherits the user's environment, not pagoda's
    assert seen["threads"] == seen["torch_threads"] == 1


def test_a_policy_the_user_set_wins_and_stays():
    seen = probe({**os.environ, "OMP_WAIT_POLICY": "ACTIVE"})
    assert seen["policy"] == "ACTIVE" and seen["env"] == "ACTIVE"
