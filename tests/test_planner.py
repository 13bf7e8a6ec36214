"""The SLO planner over recorded metric snapshots: cumulative Prometheus histograms scraped once per window
from a mesh whose latency is its load shared by its instances. Demand ramps up: it scales up at once and
stays up; demand ramps down: one instance at a time, never into a violation; a noisy plateau: it settles
and does not oscillate. Quantiles read from histogram deltas match the observations."""

from __future__ import annotations

import random

import pytest

from mesh.metrics import SECONDS
from mesh.planner import Plan, PlannerConfig, Window, decide, histogram_quantile, plan, window

CONFIG = PlannerConfig(ttft_slo_s=1.0, tpot_slo_s=0.1, settle_windows=3, min_prefill=0, max_prefill=12,
                       min_decode=1, max_decode=12)


class Router:
    """Cumulative router metrics, observed request by request and scraped as a Prometheus server would."""

    def __init__(self) -> None:
        self.counts = {name: [0] * (len(SECONDS) + 1) for name in ("ttft", "tpot")}
        self.requests = 0

    def observe(self, ttft_s: float, tpot_s: float) -> None:
        self.requests += 1
        for name, value in (("ttft", ttft_s), ("tpot", tpot_s)):
            for i, bound in enumerate([*SECONDS, float("inf")]):
                if value <= bound:
                    self.counts[name][i] += 1

    def scrape(self) -> dict:
        samples = {("infermesh_requests_total", (("outcome", "ok"),)): float(self.requests)}
        for name, metric in (("ttft", "infermesh_time_to_first_token_seconds"),
                             ("tpot", "infermesh_time_per_output_token_seconds")):
            for bound, count in zip([*map(str, SECONDS), "+Inf"], self.counts[name]):
                samples[(f"{metric}_bucket", (("le", bound),))] = float(count)
        return samples


def run(loads: list[float], prefill: int = 1, decode: int = 1, seed: int = 0) -> list[tuple[int, int, Window]]:
    """Each window: 50 requests whose latency is the load over the instances (with noise); the mesh then
    takes the plan. Returns (prefill, decode, window) per window."""
    rng, router, history, out = random.Random(seed), Router(), [], []
    before = router.scrape()
    for load in loads:
        for _ in range(50):
            noise = rng.uniform(0.9, 1.1)
            router.observe(CONFIG.ttft_slo_s * load / max(prefill, 0.5) * noise,
                           CONFIG.tpot_slo_s * load / decode * noise)
        after = router.scrape()
        history.append(window(before, after, 10.0))
        before = after
        out.append((prefill, decode, history[-1]))
        decided = plan(history, prefill, decode, CONFIG)
        prefill, decode = decided.prefill, decided.decode
    return out


def test_a_histogram_quantile_of_a_window_is_the_observations():
    router = Router()
    before = router.scrape()
    for i in range(1000):  # uniform over (0, 1 s]
        router.observe((i + 1) / 1000, 0.05)
    q = histogram_quantile(0.9, before, router.scrape(), "infermesh_time_to_first_token_seconds")
    assert q == pytest.approx(0.9, abs=0.03)  # interpolated inside the (0.75, 1.0] bucket
    assert histogram_quantile(0.9, router.scrape(), router.scrape(), "infermesh_time_to_first_token_seconds") is None


def test_a_ramp_up_scales_up_at_once_and_never_back_down_while_it_climbs():
    history = run([0.5, 0.8, 1.5, 2.5, 4.0, 6.0, 6.0, 6.0])
    decodes = [d for _, d, _ in history]
    assert decodes == sorted(decodes) and decodes[-1] >= 6  # up only, to the load
    assert history[-1][2].tpot_p90_s <= CONFIG.tpot_slo_s  # and within the SLO at the end


def test_a_ramp_down_steps_down_one_at_a_time_without_violating_the_slo():
    loads = [6.0] * 3 + [3.0] * 8 + [1.0] * 12 + [0.2] * 12
    history = run(loads, prefill=7, decode=7)  # load 6 on 7 instances: within the SLO
    decodes = [d for _, d, _ in history]
    assert decodes == sorted(decodes, reverse=True) and decodes[-1] < 7
    assert all(later - earlier >= -1 for earlier, later in zip(decodes, decodes[1:]))  # one step at a time
    assert all(w.tpot_p90_s <= CONFIG.tpot_slo_s for _, _, w in history)  # no step down overshot
    assert decodes[-1] == 1 and history[-1][0] <= 1  # it does come down


def test_a_noisy_plateau_settles_and_does_not_oscillate():
    rng = random.Random(7)
    loads = [3.0 * rng.uniform(0.85, 1.15) for _ in range(60)]
    history = run(loads, prefill=1, decode=1, seed=3)
    decodes = [d for _, d, _ in history[10:]]  # after it settled
    changes = sum(a != b for a, b in zip(decodes, decodes[1:]))
    assert changes <= 1 and max(decodes) - min(decodes) <= 1


def test_bounds_hold_and_a_bad_config_is_named():
    assert decide(12, [5.0], 1.0, 0, 12, 0.5, 3)[0] == 12  # at the ceiling
    assert decide(1, [None, None, None], 1.0, 1, 12, 0.5, 3)[0] == 1  # idle, at the floor
    assert decide(0, [3.0], 1.0, 0, 12, 0.5, 3)[0] == 2  # none yet and 3x over: it starts some (at most 2x 1)
    assert decide(2, [1.4], 1.0, 0, 12, 0.5, 3)[0] == 3  # 1.4x over: ceil(2 * 1.4)
    unchanged = plan([], 2, 2, CONFIG)  # no window yet
    assert isinstance(unchanged, Plan) and (unchanged.prefill, unchanged.decode) == (2, 2)
    with pytest.raises(ValueError, match=r"low_water must be in \(0, 1\), got 1.5"):
        PlannerConfig(low_water=1.5)
    with pytest.raises(ValueError, match=r"1 <= min_decode \(0\)"):
        PlannerConfig(min_decode=0)


def test_the_router_exports_its_planners_recommendation_for_a_cluster_autoscaler(tiny_checkpoint):
    """router.planner_watch: over its SLOs the router's planner asks for more instances of both roles at once,
    and idle windows bring the count back down one at a time; the mesh's gauges say what it holds."""
    from mesh.metrics import scrape
    from tests.helpers import wait_until
    from tests.test_router import generate
    from tests.tiny_mesh import tiny_mesh

    folder, _ = tiny_checkpoint("llama")
    with tiny_mesh(folder, ttft_slo_s=1e-6, tpot_slo_s=1e-6, planner_interval_s=0.2,
                   local_prefill_max_tokens=4) as mesh:
        def gauge(name: str, role: str) -> float:
            return scrape(mesh.router.metrics.url)[(name, (("role", role),))]

        assert gauge("infermesh_planner_desired_instances", "decode") == 1  # no window yet: what the mesh has
        assert gauge("infermesh_mesh_instances", "prefill") == gauge("infermesh_mesh_instances", "decode") == 1
        assert gauge("infermesh_mesh_kv_blocks_total", "decode") == mesh.decode.record().kv_blocks_total > 0
        assert generate(mesh.router.address, list(range(5, 40)))[0]  # disaggregated: a TTFT and TPOTs over the SLOs
        wait_until(lambda: (gauge("infermesh_planner_desired_instances", "prefill"),
                            gauge("infermesh_planner_desired_instances", "decode")) == (2, 2))
        wait_until(lambda: (gauge("infermesh_planner_desired_instances", "prefill"),
                            gauge("infermesh_planner_desired_instances", "decode")) == (0, 1))  # quiet: down
