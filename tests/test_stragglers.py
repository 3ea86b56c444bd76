"""Straggler detection: the pure scores, the risk factor, the monitor against a real etcd
(the agent leaving the job and eft-run end to end: test_stragglers_agent.py)."""

import json
import subprocess
import sys

import pytest

from elasticft.agent.stragglers import (
    MIN_STEPS,
    RankStep,
    StragglerLatch,
    StragglerMonitor,
    StragglerScore,
    current_step_time,
    may_leave,
    parse_steps_record,
    ratio_score,
    score_ranks,
    steps_record,
    straggler_factor,
)
from elasticft.config import ConfigError, RiskConfig, StragglerConfig
from elasticft.contract.progress import progress_dir
from elasticft.health import GpuSample, RiskModel
from elasticft.worker.progress import ProgressWriter
from tests.test_health_risk import busy, run


def ranks(times, node="n0", first_rank=0):
    return [RankStep(node, first_rank + i, i, i, t) for i, t in enumerate(times)]


def score(times, best=None, own=None, rel=0.7, ind=0.7):
    everyone = ranks(times)
    return score_ranks(own if own is not None else everyone, everyone, best or {}, rel, ind)


# -- pure scoring --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "times, expected",
    [
        ((), None),
        ((0.1,), None),
        ((0.1, 0.2), None),  # fewer than MIN_STEPS: too early to judge
        ((0.1, 0.2, 0.3), 0.2),
        ((0.1, 0.1, 0.1, 5.0), 0.1),  # one step that waited on a save does not count
        ((0.3, 0.1, 0.2, 0.4), 0.25),
    ],
)
def test_current_step_time_is_the_median_of_enough_steps(times, expected):
    assert MIN_STEPS == 3
    assert current_step_time(times) == (None if expected is None else pytest.approx(expected))


@pytest.mark.parametrize(
    "reference, step_time, expected",
    [(1.0, 1.0, 1.0), (1.0, 2.0, 0.5), (2.0, 1.0, 1.0), (0.05, 0.35, 0.05 / 0.35), (1.0, 0.0, 1.0)],
)
def test_ratio_score_is_capped_at_one(reference, step_time, expected):
    assert ratio_score(reference, step_time) == pytest.approx(expected)


def test_the_job_median_decides_the_relative_score():
    scores = score([0.1, 0.1, 0.1, 0.4])
    assert [s.job_median for s in scores] == [0.1] * 4
    assert [s.relative for s in scores] == pytest.approx([1, 1, 1, 0.25])
    assert [s.individual for s in scores] == [1, 1, 1, 1]  # first look: each is its own best
    assert [s.straggler for s in scores] == [False, False, False, True]
    assert scores[3].rank == 3 and scores[3].step_time == 0.4


def test_fast_ranks_are_never_stragglers():
    scores = score([0.05, 0.06, 0.04, 0.05, 0.35])
    assert [s.straggler for s in scores] == [False, False, False, False, True]
    assert all(s.relative == 1.0 for s in scores[:4] if s.step_time <= s.job_median)


def test_a_rank_just_below_and_just_above_the_threshold():
    # median 1.0; 1/1.42 = 0.704 is not a straggler, 1/1.43 = 0.699 is.
    assert [s.straggler for s in score([1.0, 1.0, 1.0, 1.42])] == [False] * 4
    assert [s.straggler for s in score([1.0, 1.0, 1.0, 1.43])][3]


def test_all_equally_slow_are_not_relative_stragglers_but_individual_ones():
    best = {("n0", i): 0.1 for i in range(4)}
    scores = score([0.3] * 4, best=best)
    assert all(s.relative == 1.0 for s in scores)
    assert all(s.individual == pytest.approx(1 / 3) for s in scores)
    assert all(s.straggler for s in scores)
    # Only the relative score asked for: nobody is behind the job.
    assert not any(s.straggler for s in score([0.3] * 4, best=best, ind=0.01))


def test_the_best_so_far_includes_the_current_time():
    scores = score([0.1, 0.2], best={("n0", 0): 0.2, ("n0", 1): 0.1})
    assert [s.best for s in scores] == [0.1, 0.1]  # rank 0 got faster: its new best
    assert [s.individual for s in scores] == pytest.approx([1.0, 0.5])


def test_two_ranks_have_the_mean_as_median():
    slow = score([0.1, 0.3])[1]
    assert slow.job_median == pytest.approx(0.2) and slow.relative == pytest.approx(2 / 3)


def test_own_ranks_are_scored_against_every_node():
    everyone = ranks([0.1, 0.1], "a") + ranks([0.1, 0.5], "b", first_rank=2)
    own = [r for r in everyone if r.node == "b"]
    scores = score_ranks(own, everyone, {}, 0.7, 0.7)
    assert [(s.node, s.rank, s.straggler) for s in scores] == [("b", 2, False), ("b", 3, True)]
    assert scores[1].relative == pytest.approx(0.2)
    assert score_ranks([], [], {}, 0.7, 0.7) == []


def test_nobody_is_scored_until_every_rank_of_the_job_has_a_time():
    everyone = ranks([0.05, 0.35])  # this node's ranks; the other node's not published yet
    assert score_ranks(everyone, everyone, {}, 0.7, 0.7, world_size=4) == []
    full = everyone + ranks([0.05, 0.05], "n1", first_rank=2)
    slow = score_ranks(everyone, full, {}, 0.7, 0.7, world_size=4)[1]
    assert slow.relative == pytest.approx(0.05 / 0.35)
    # Without the gate, the node's own two ranks would make a median of 0.2 s.
    assert score_ranks(everyone, everyone, {}, 0.7, 0.7)[1].relative == pytest.approx(0.2 / 0.35)


@pytest.mark.parametrize(
    "relative, individual, expected",
    [(1.0, 1.0, 0.0), (0.7, 1.0, 0.0), (0.75, 0.71, 0.0), (0.35, 1.0, 0.5), (1.0, 0.35, 0.5),
     (0.35, 0.14, 0.8), (0.0, 1.0, 1.0)],
)
def test_straggler_factor_rises_from_the_threshold_to_one(relative, individual, expected):
    s = StragglerScore(0, "n", 0, 0, 1.0, 1.0, 1.0, relative, individual, False)
    assert straggler_factor(s, 0.7, 0.7) == pytest.approx(expected)


def test_latch_reports_once_until_recovered():
    def s(rank, straggler):
        return StragglerScore(rank, "n", rank, rank, 1.0, 1.0, 1.0, 0.5 if straggler else 1.0, 1.0, straggler)

    latch = StragglerLatch()
    assert latch.update([s(0, False), s(1, True)]) == ([s(1, True)], [])
    assert latch.update([s(0, False), s(1, True)]) == ([], [])
    assert latch.update([s(0, False)]) == ([], [])  # rank 1 not scored: still a straggler
    assert list(latch.active) == [("n", 1)]
    assert latch.update([s(1, False)]) == ([], [s(1, True)])
    assert latch.update([s(1, True)]) == ([s(1, True)], [])


@pytest.mark.parametrize("others, min_nodes, leaves", [(1, 1, True), (0, 1, False), (2, 3, False), (3, 3, True)])
def test_a_node_leaves_only_if_the_others_make_the_minimum(others, min_nodes, leaves):
    assert may_leave(others, min_nodes) == leaves


def test_steps_record_round_trip_and_staleness():
    value = steps_record("n0", ranks([0.1, 0.2]), now=1000.0)
    assert parse_steps_record(value, now=1004.0, max_age=5.0) == ranks([0.1, 0.2])
    assert parse_steps_record(value, now=1006.0, max_age=5.0) == []
    assert parse_steps_record(b"not json", now=0, max_age=5) == []
    assert parse_steps_record(json.dumps({"time": 0, "ranks": [{"rank": 1}]}), now=0, max_age=5) == []


@pytest.mark.parametrize(
    "kwargs",
    [{"straggler_interval": -1}, {"straggler_relative": 0}, {"straggler_relative": 1.5},
     {"straggler_individual": -0.1}, {"straggler_action": "kick"}],
)
def test_config_rejects_and_names_the_flag(kwargs):
    flag = "--eft-" + next(iter(kwargs)).replace("_", "-")
    with pytest.raises(ConfigError, match=flag):
        StragglerConfig(**kwargs)


# -- the risk factor -----------------------------------------------------------------------


def sample(gpu, t, node="n0"):
    return GpuSample(timestamp=1_714_564_800.0 + t, node=node, gpu=gpu, temperature_c=65.0,
                     memory_used_mib=60_000.0, memory_total_mib=81_559.0, utilization_pct=97.0)


def test_straggler_factor_is_no_data_until_set_and_then_weighs_in():
    model = RiskModel(RiskConfig())
    before = model.update([sample(0, 0), sample(1, 0)])
    assert all(s.factors["straggler"] is None for s in before)
    model.set_straggler("n0", 1, 0.8)
    after = model.update([sample(0, 10), sample(1, 10)])
    assert after[0].factors["straggler"] is None and after[1].factors["straggler"] == 0.8
    weight = RiskConfig().weights()["straggler"]
    assert after[1].contributions["straggler"] == pytest.approx(weight * 0.8)
    assert after[1].score == pytest.approx(1 - (1 - after[0].score) * (1 - weight * 0.8))
    assert after[1].score > after[0].score and after[1].dominant == "straggler"
    model.set_straggler("n0", 1, None)
    assert model.update([sample(1, 20)])[0].factors["straggler"] is None


def distressed(t, gpu=0):
    """Above its slowdown temperature and nearly out of memory: a telemetry score of about 0.6."""
    return GpuSample(timestamp=1_714_564_800.0 + t, node="n0", gpu=gpu, temperature_c=87.0,
                     memory_used_mib=81_300.0, memory_total_mib=81_559.0)


@pytest.mark.parametrize("factor", [0.0, 0.2])
def test_a_healthy_rank_or_a_mild_straggler_never_lowers_the_score(factor):
    plain, scored = RiskModel(), RiskModel()
    scored.set_straggler("n0", 0, factor)
    before, after = plain.update([distressed(0)])[0], scored.update([distressed(0)])[0]
    assert before.score > factor  # the telemetry says more than the straggler factor
    assert after.score >= before.score and after.factors["straggler"] == factor
    assert after.dominant == before.dominant
    if factor == 0.0:
        assert after.score == before.score and "straggler" not in after.contributions


def test_a_straggler_adds_its_weight_by_noisy_or_and_never_triggers_alone():
    plain, scored = RiskModel(), RiskModel()
    scored.set_straggler("n0", 0, 1.0)
    before, after = plain.update([distressed(0)])[0], scored.update([distressed(0)])[0]
    weight = RiskConfig().weights()["straggler"]
    assert after.score == pytest.approx(1 - (1 - before.score) * (1 - weight)) and after.score > before.score
    # Full telemetry on an otherwise healthy GPU: a full straggler alone is its weight, below the threshold.
    healthy = RiskModel()
    healthy.set_straggler("n", 0, 1.0)
    alone = run(healthy, [[busy(0, 10 * i), busy(1, 10 * i)] for i in range(10)])[0]
    assert alone.score == pytest.approx(weight) and alone.dominant == "straggler" and not alone.triggered


# -- the monitor, against a real etcd -------------------------------------------------------


def write_heartbeat(run_dir, rank, local_rank, step_times):
    """A rank's heartbeat after these steps, through the worker's own writer (fake clock)."""
    now = [0.0]
    writer = ProgressWriter(run_dir, rank, local_rank, clock=lambda: now[0])
    writer.step(0)
    for i, seconds in enumerate(step_times):
        writer.add_work(seconds)
        now[0] += seconds + 0.01  # the collective: wall time is not work time
        writer.step(i + 1)


class Node:
    def __init__(self, agent_context, name, config, **kwargs):
        self.ctx = agent_context(name)
        self.run_dir = self.ctx.run_dir
        self.risk = {}
        self.monitor = StragglerMonitor(
            config, self.ctx, set_risk=lambda node, gpu, value: self.risk.__setitem__((node, gpu), value), **kwargs,
        )

    @property
    def events(self) -> list[tuple[str, dict]]:
        return [(e["kind"], e) for e in self.ctx.events.read() if e["source"] == self.ctx.node_id]

    def beats(self, first_rank, per_rank):
        for local_rank, times in enumerate(per_rank):
            write_heartbeat(self.run_dir, first_rank + local_rank, local_rank, times)


def test_monitor_scores_two_nodes_and_reports_once(etcd, run_keys, agent_context, tmp_path):
    config = StragglerConfig(straggler_interval=2)
    a = Node(agent_context, "node-a", config, gpu_of=lambda lr: lr + 4, world_size=lambda: 4)
    b = Node(agent_context, "node-b", config)
    a.beats(0, [[0.1] * 8, [0.4] * 8])  # rank 1 is four times slower
    b.beats(2, [[0.1] * 8, [0.11] * 8])
    assert a.monitor.check_once() == []  # b has not published: a sees 2 of the job's 4 ranks
    b.monitor.check_once()  # publishes b's figures
    scores = a.monitor.check_once()
    assert [(s.rank, s.gpu, s.straggler) for s in scores] == [(0, 4, False), (1, 5, True)]
    assert scores[1].job_median == pytest.approx(0.105) and scores[1].relative == pytest.approx(0.105 / 0.4)
    (kind, fields), = a.events
    assert kind == "straggler"
    assert (fields["rank"], fields["node"], fields["gpu"], fields["local_rank"]) == (1, "node-a", 5, 1)
    assert fields["step_time"] == pytest.approx(0.4) and fields["relative"] == pytest.approx(0.2625, abs=1e-4)
    assert fields["individual"] == 1.0
    assert (fields["relative_threshold"], fields["individual_threshold"], fields["action"]) == (0.7, 0.7, "report")
    assert a.risk[("node-a", 4)] == 0.0 and a.risk[("node-a", 5)] == pytest.approx((0.7 - 0.2625) / 0.7, abs=1e-3)
    assert [s.straggler for s in b.monitor.check_once()] == [False, False] and b.events == []
    assert [s.straggler for s in a.monitor.check_once()] == [False, True]
    assert len(a.events) == 1  # still a straggler: reported once
    assert [r.rank for r in a.monitor.stragglers] == [1]
    assert not a.monitor.wants_exclusion()  # action report

    # Rank 1 recovers, then slows down again: a second report.
    a.beats(0, [[0.1] * 8, [0.1] * 8])
    assert not any(s.straggler for s in a.monitor.check_once()) and len(a.events) == 1
    assert a.monitor.stragglers == []
    a.beats(0, [[0.1] * 8, [0.5] * 8])
    a.monitor.check_once()
    assert len(a.events) == 2 and a.events[1][1]["rank"] == 1
    # Its best so far was 0.1 s: individually it is five times slower, too.
    assert a.events[1][1]["individual"] == pytest.approx(0.2)


def test_monitor_best_survives_a_worker_restart_and_a_job_wide_slowdown_is_individual(etcd, run_keys, agent_context, tmp_path):
    node = Node(agent_context, "n", StragglerConfig(straggler_interval=2))
    node.beats(0, [[0.1] * 5, [0.1] * 5])
    assert not any(s.straggler for s in node.monitor.check_once())
    # The workers restart (fresh heartbeats, new ranks) and everyone is three times slower.
    for path in progress_dir(node.run_dir).iterdir():
        path.unlink()
    node.beats(4, [[0.3] * 5, [0.3] * 5])
    scores = node.monitor.check_once()
    assert [(s.rank, s.relative, s.straggler) for s in scores] == [(4, 1.0, True), (5, 1.0, True)]
    assert all(s.individual == pytest.approx(1 / 3) for s in scores)


def test_monitor_skips_young_dead_and_stale_ranks(etcd, run_keys, agent_context, tmp_path):
    config = StragglerConfig(straggler_interval=2)
    a = Node(agent_context, "a", config)
    a.beats(0, [[0.1] * 5, [0.1, 0.9]])  # rank 1: two steps, too early to judge
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], check=True, capture_output=True,
                          text=True)
    write_heartbeat(a.run_dir, 2, 2, [5.0] * 5)
    path = progress_dir(a.run_dir) / "2.json"
    record = json.loads(path.read_text())
    record["pid"] = int(dead.stdout)  # a worker of an earlier round that has exited
    path.write_text(json.dumps(record))
    # Node b's agent is stuck: its last record is older than 2.5 intervals.
    b = Node(agent_context, "b", config, clock=lambda: 0.0)
    b.beats(3, [[9.0] * 5])
    b.monitor.check_once()
    scores = a.monitor.check_once()
    assert [(s.rank, s.job_median) for s in scores] == [(0, 0.1)]
    assert a.events == []


def test_steps_vanish_with_the_node_lease(etcd, run_keys, agent_context, tmp_path):
    node = Node(agent_context, "n", StragglerConfig())
    node.beats(0, [[0.1] * 4])
    node.monitor.check_once()
    value = json.loads(etcd.get(run_keys.steps("n")).value)
    assert value["node"] == "n" and [r["step_time"] for r in value["ranks"]] == [0.1]
    node.ctx.lease.revoke()
    assert etcd.get(run_keys.steps("n")) is None


def test_exclusion_is_wanted_only_with_the_exclude_action(etcd, run_keys, agent_context, tmp_path):
    node = Node(agent_context, "n", StragglerConfig(straggler_action="exclude"))
    node.beats(0, [[0.1] * 4, [0.1] * 4, [1.0] * 4])
    assert not node.monitor.wants_exclusion()
    node.monitor.check_once()
    assert node.monitor.wants_exclusion() and node.events[0][1]["action"] == "exclude"
    node.beats(0, [[0.1] * 4, [0.1] * 4, [0.1] * 4])
    node.monitor.check_once()
    assert not node.monitor.wants_exclusion()  # recovered before the restart: it stays


def test_the_straggler_factor_reaches_the_published_health_record(etcd, run_keys, agent_context, tmp_path):
    """Monitor -> RiskModel.set_straggler -> sampler -> health/<node>/<gpu>, as the agent wires them."""
    from pathlib import Path

    from elasticft.health import EtcdHealthPublisher, HealthSampler
    from elasticft.health.sources import ReplaySource

    source = ReplaySource(Path(__file__).parent / "data" / "healthy.csv", node="node-a")
    sampler = HealthSampler(source, RiskModel(), publish=EtcdHealthPublisher(etcd, run_keys, "node-a", None))
    monitor = StragglerMonitor(StragglerConfig(), agent_context("node-a", tmp_path),
                               set_risk=sampler.model.set_straggler)
    for local_rank, seconds in enumerate([0.1, 0.1, 0.1, 0.5]):
        write_heartbeat(tmp_path, local_rank, local_rank, [seconds] * 4)
    sampler.sample_once()
    monitor.check_once()
    sampler.sample_once()
    records = {g: json.loads(etcd.get(run_keys.health("node-a", g)).value) for g in range(4)}
    assert [records[g]["factors"]["straggler"] for g in range(3)] == [0.0, 0.0, 0.0]
    assert records[3]["factors"]["straggler"] == pytest.approx((0.7 - 0.2) / 0.7, abs=1e-3)
    assert records[3]["score"] > records[2]["score"]  # it raised the score of GPU 3 only
    assert json.loads(etcd.get(run_keys.health("node-a", 5)).value)["factors"]["straggler"] is None


def test_monitor_events_reach_etcd_and_the_thread_stops(etcd, run_keys, agent_context, tmp_path):
    ctx = agent_context("n", tmp_path)
    log = ctx.events
    monitor = StragglerMonitor(StragglerConfig(straggler_interval=3600), ctx)
    for local_rank, seconds in enumerate([0.1, 0.1, 0.5]):
        write_heartbeat(tmp_path, local_rank, local_rank, [seconds] * 4)
    monitor.check_once()
    event, = log.read()
    assert (event["kind"], event["rank"], event["source"]) == ("straggler", 2, "n")
    monitor.start()
    monitor.stop()  # the stop event wakes the wait: returns at once
    assert not monitor.running
