import os

# The CPU set-up every entry point shares (pagoda/core/machine.py): before anything imports torch.
from pagoda.core.machine import prepare_process

prepare_process()

from hypothesis import HealthCheck, settings

# `make test` runs the CI profile; HYPOTHESIS_PROFILE=deep runs thousands of crowds.
settings.register_profile("ci", max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("deep", max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Session fixtures for the default model (imported once per session into $PAGODA_HOME or a tmp dir)
# and live servers (real uvicorn on 127.0.0.1, port 0).
pytest_plugins = ["tests.model_fixtures", "tests.server_fixtures"]


def pytest_sessionstart(session):
    # pagoda's C++ CPU kernels compile on first use (a few tens of seconds, once per $PAGODA_HOME): here,
    # not inside a test that times a server's start-up. Where they cannot build, their tests skip.
    from pagoda.kernels import cpu_native

    cpu_native.load()
