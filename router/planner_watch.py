"""The router's own planner, as metrics a cluster's autoscaler follows.

Every `planner_interval_s` a thread reads the router's metrics (one window of them, `mesh.planner.window`),
keeps the last `settle_windows` + 1 windows, and runs `mesh.planner.plan` over them with the mesh's serving
prefill and decode instances (the registry snapshot the router routes on). What it decided is exported as
`infermesh_planner_desired_instances{role}`: KEDA's Prometheus trigger or an HPA on external metrics scales
each workload to it (the Helm chart's `autoscaling`), so the planner's hysteresis, not the autoscaler's,
decides when to step; `infermesh_planner_slo_seconds{slo}` says what it sizes against (ttft, tpot).
Beside them, what the mesh holds now, read from the same snapshot at each scrape:
`infermesh_mesh_instances{role}`, `infermesh_mesh_active_requests{role}`,
`infermesh_mesh_kv_blocks_used{role}` and `infermesh_mesh_kv_blocks_total{role}`.

Until its first window has passed the planner recommends what the mesh has.
"""

from __future__ import annotations

import threading
from collections import deque

from opentelemetry.metrics import Observation

from mesh import planner
from mesh.metrics import Metrics
from mesh.planner import PlannerConfig
from mesh.registry import InstanceInfo, InstanceState, Role

ROLES = (Role.PREFILL, Role.DECODE)


class PlannerWatch:
    def __init__(self, metrics: Metrics, instances, config: PlannerConfig, interval_s: float) -> None:
        """`instances()`: the registry's instances now (the router's snapshot)."""
        self.metrics, self.instances, self.config, self.interval_s = metrics, instances, config, interval_s
        self.desired: dict[Role, int] | None = None  # None: no window yet (recommend what the mesh has)
        self._windows: deque[planner.Window] = deque(maxlen=config.settle_windows + 1)
        self._stop = threading.Event()
        meter = metrics.meter
        meter.create_observable_gauge(
            "infermesh_planner_desired_instances", description="Instances of each role the SLO planner recommends",
            callbacks=[lambda _: self._per_role(lambda role, mine: (self.desired or {}).get(role, len(mine)))])
        slos = {"ttft": config.ttft_slo_s, "tpot": config.tpot_slo_s}
        meter.create_observable_gauge(
            "infermesh_planner_slo", unit="s", description="The p90 SLOs the planner sizes the roles against",
            callbacks=[lambda _: [Observation(value, {"slo": slo}) for slo, value in slos.items()]])
        for name, description, read in (
                ("instances", "Serving instances of each role", len),
                ("active_requests", "Requests in flight on each role's instances",
                 lambda mine: sum(i.active_requests for i in mine)),
                ("kv_blocks_used", "KV cache blocks in use on each role's instances",
                 lambda mine: sum(i.kv_blocks_used for i in mine)),
                ("kv_blocks_total", "KV cache blocks of each role's instances",
                 lambda mine: sum(i.kv_blocks_total for i in mine))):
            meter.create_observable_gauge(f"infermesh_mesh_{name}", description=description,
                                          callbacks=[lambda _, read=read: self._per_role(lambda r, mine: read(mine))])
        self._thread = threading.Thread(target=self._run, name="planner-watch", daemon=True)
        self._thread.start()

    def _serving(self) -> dict[Role, list[InstanceInfo]]:
        found = [i for i in self.instances() if i.state is InstanceState.SERVING]
        return {role: [i for i in found if i.role is role] for role in ROLES}

    def _per_role(self, value) -> list:
        return [Observation(value(role, mine), {"role": role.value}) for role, mine in self._serving().items()]

    def _run(self) -> None:
        before = self.metrics.samples()
        while not self._stop.wait(self.interval_s):
            after = self.metrics.samples()
            self._windows.append(planner.window(before, after, self.interval_s))
            before = after
            serving = self._serving()
            decided = planner.plan(list(self._windows), len(serving[Role.PREFILL]), len(serving[Role.DECODE]),
                                   self.config)
            self.desired = {Role.PREFILL: decided.prefill, Role.DECODE: decided.decode}

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
