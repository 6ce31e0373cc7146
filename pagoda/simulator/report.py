"""What a simulated crowd came to: each client's result, the run's report, and each tenant's share.

simulator/simulate.py fills them as the crowd runs; `pagoda simulate` prints the report (`summary()` is its --json
shape), the fleet's report (simulator/fleet.py) extends it per replica, and the acceptance checks read it.
No torch here.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field


@dataclass
class ClientResult:
    client_id: str
    status: str = "pending"  # completed | hung_up | refused
    finish_reason: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    ttft: float | None = None  # simulated seconds from arrival to first token
    e2e: float | None = None  # simulated seconds from arrival to the end
    matches_solo: bool | None = None
    error: str | None = None
    steps_to_release: int | None = None  # hung-up clients: steps until their blocks were back
    tenant: str | None = None
    solo_ttft: float | None = None  # completed clients: the TTFT of its solo rerun (its TTFT alone)


@dataclass
class SimulationReport:
    clients: int
    completed: int
    hung_up: int
    refused: int
    peak_running: int
    preemptions: int
    recomputed_tokens: int
    aborted: int
    generated_tokens: int
    prefix_queried_tokens: int  # prompt tokens looked up in the prefix cache (prompt + output on a resume)
    prefix_hit_tokens: int  # of which were found there and not computed
    draft_tokens: int  # n-gram drafts the greedy clients were given in padded rows (core/speculative.py)
    accepted_tokens: int  # of which kept
    adapter_steps: int  # steps that ran a LoRA adapter's rows
    mixed_adapter_steps: int  # steps whose rows were of two or more of: the base, each adapter
    peak_step_adapters: int  # the most distinct adapters (the base not counted) in one step: at most max_loras
    steps: int
    solo_steps: int  # the solo reruns' steps, all together
    simulated_seconds: float
    pool: dict[str, int]
    audit: str
    matches_solo: bool
    wall_seconds: float
    wall_us_per_step: float  # wall time over every step taken (crowd pass and solo reruns), events and audits included
    max_steps_to_release: int
    # per tenant ("default" for None): {"clients", "completed", "ttft_p50", "ttft_alone_p50", "generated_tokens",
    # "share_while_active"}: its generated tokens over everyone's, in the steps it had a request in flight
    tenants: dict[str, dict]
    results: list[ClientResult]

    @property
    def ok(self) -> bool:
        return self.audit == "ok" and self.pool["free"] == self.pool["total"] and self.matches_solo

    def summary(self) -> dict:
        """The report without per-client results (the --json shape)."""
        out = asdict(self)
        out.pop("results")
        return out


def _median(values: list[float]) -> float | None:
    values = sorted(values)
    return round(values[len(values) // 2], 6) if values else None


def tenant_summary(results: Iterable[ClientResult], activity: TenantActivity | None) -> dict[str, dict]:
    """Each tenant's clients, TTFT p50 (in the crowd and alone), generated tokens and share while active."""
    by_tenant: dict[str | None, list[ClientResult]] = {}
    for r in results:
        by_tenant.setdefault(r.tenant, []).append(r)
    out = {}
    for tenant, group in by_tenant.items():
        done = [r for r in group if r.status == "completed"]
        out["default" if tenant is None else tenant] = {
            "clients": len(group),
            "completed": len(done),
            "ttft_p50": _median([r.ttft for r in done if r.ttft is not None]),
            "ttft_alone_p50": _median([r.solo_ttft for r in done if r.solo_ttft is not None]),
            "generated_tokens": sum(len(r.output_token_ids) for r in group),
            "share_while_active": activity.share(tenant) if activity is not None else None,
        }
    return out


class TenantActivity:
    """Who had a request in flight (arrived, not yet left) in each step, and the tokens each step generated."""

    def __init__(self) -> None:
        self.in_flight: dict[str | None, int] = {}
        self.own: dict[str | None, int] = {}  # tokens a tenant generated in the steps it was active
        self.everyone: dict[str | None, int] = {}  # tokens every tenant generated in those steps

    def count_step(self, active: list[str | None], tokens: dict[str | None, int]) -> None:
        total = sum(tokens.values())
        for tenant in active:
            self.own[tenant] = self.own.get(tenant, 0) + tokens.get(tenant, 0)
            self.everyone[tenant] = self.everyone.get(tenant, 0) + total

    def active(self) -> list[str | None]:
        return [t for t, n in self.in_flight.items() if n > 0]

    def share(self, tenant: str | None) -> float | None:
        everyone = self.everyone.get(tenant, 0)
        return round(self.own.get(tenant, 0) / everyone, 4) if everyone else None
