"""The built-in scheduling policies, registered exactly as a third-party package's would be.

fcfs (the default), priority and fair live in pagoda.core.scheduling, next to the scheduler that asks them
(core imports no plugins); this plugin makes them choosable by name: `pagoda serve --scheduling-policy NAME`.
"""

from __future__ import annotations

from pagoda.core.scheduling import FairPolicy, PriorityPolicy, SchedulingPolicy
from pagoda.plugins.hookspecs import hookimpl


@hookimpl
def pagoda_register_scheduling_policies(register):
    register(SchedulingPolicy)  # fcfs
    register(PriorityPolicy)
    register(FairPolicy)
