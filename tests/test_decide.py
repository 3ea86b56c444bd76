"""The agent's monitor decision on its own: what each observation calls for."""

import signal

import pytest
from torch.distributed.elastic.agent.server.api import WorkerState

from elasticft.agent.decide import (
    REPORT,
    Observation,
    RestartReason,
    Verdict,
    decide,
    restart_reason,
    torchs_restart,
)
from elasticft.agent.hangs import Overrun
from elasticft.contract.records import NodeRecord

LOST = (NodeRecord("n3", "host3", "host3", 42),)
FAILED_PEER = (NodeRecord("n2", "host2", "host2", 41, failed_round=5),)  # its workers of this round failed
HUNG = (Overrun(rank=1, local_rank=1, pid=99, section="step", seconds=9.0, timeout=3.0, iteration=7,
                dump_signal=None),)


def test_healthy_workers_with_nothing_else_seen_keep_torchs_result():
    assert decide(Observation(WorkerState.HEALTHY)) is REPORT


@pytest.mark.parametrize("state", [WorkerState.HEALTHY, WorkerState.FAILED, WorkerState.UNHEALTHY])
def test_a_lost_node_restarts_at_once_with_sigkill_and_is_not_charged(state):
    decision = decide(Observation(state, lost=LOST))
    assert decision.verdict is Verdict.RESTART and decision.reason is RestartReason.MEMBERSHIP
    assert decision.stop_signal == signal.SIGKILL  # ranks with a dead peer cannot save
    assert decision.lost == LOST


def test_a_failure_while_nodes_wait_to_join_is_a_membership_restart_with_sigterm():
    decision = decide(Observation(WorkerState.FAILED, lost=()))
    assert (decision.verdict, decision.reason, decision.stop_signal) == (
        Verdict.RESTART, RestartReason.MEMBERSHIP, signal.SIGTERM)


def test_an_unexplained_failure_is_torchs_to_charge():
    assert decide(Observation(WorkerState.FAILED)) is REPORT


def test_a_hung_rank_is_a_charged_failure_and_gets_sigkill():
    decision = decide(Observation(WorkerState.HEALTHY, overruns=HUNG))
    assert (decision.verdict, decision.reason, decision.stop_signal) == (
        Verdict.HANG, RestartReason.HANG, signal.SIGKILL)


def test_a_lost_node_comes_before_a_hang_its_peers_show():
    decision = decide(Observation(WorkerState.HEALTHY, lost=LOST, overruns=HUNG))
    assert decision.verdict is Verdict.RESTART and decision.reason is RestartReason.MEMBERSHIP


@pytest.mark.parametrize("state", [WorkerState.HEALTHY, WorkerState.FAILED])
def test_a_fenced_node_kills_its_workers_first_and_is_not_charged(state):
    # its workers belong to a round that is over: no save of theirs may race the new round's
    decision = decide(Observation(state, lost=LOST, overruns=HUNG, fenced=True))
    assert (decision.verdict, decision.reason, decision.stop_signal) == (
        Verdict.RESTART, RestartReason.FENCED, signal.SIGKILL)


def test_workers_that_finished_on_a_fenced_node_finished():
    assert decide(Observation(WorkerState.SUCCEEDED, fenced=True)) is REPORT


def test_workers_that_exited_after_a_signal_save_are_restarted_not_finished():
    decision = decide(Observation(WorkerState.SUCCEEDED, signal_save=True))
    assert (decision.verdict, decision.reason, decision.stop_signal) == (
        Verdict.RESTART, RestartReason.SIGNAL_SAVE, signal.SIGTERM)


def test_success_is_success_even_if_a_node_left_meanwhile():
    assert decide(Observation(WorkerState.SUCCEEDED, lost=LOST)) is REPORT
    assert decide(Observation(WorkerState.SUCCEEDED)) is REPORT


def test_torchs_own_restarts_say_why_a_failure_or_a_scale_up():
    assert restart_reason(REPORT, WorkerState.FAILED) is RestartReason.WORKER_FAILED
    assert restart_reason(REPORT, WorkerState.UNHEALTHY) is RestartReason.WORKER_FAILED
    assert restart_reason(REPORT, WorkerState.HEALTHY) is RestartReason.MEMBERSHIP  # nodes wait to join
    hang = decide(Observation(WorkerState.HEALTHY, overruns=HUNG))
    assert restart_reason(hang, WorkerState.FAILED) is RestartReason.HANG


@pytest.mark.parametrize("state", [WorkerState.HEALTHY, WorkerState.FAILED, WorkerState.UNHEALTHY])
def test_a_member_whose_workers_failed_restarts_the_others_at_once_with_sigkill_uncharged(state):
    decision = decide(Observation(state, failed_peers=FAILED_PEER))
    assert (decision.verdict, decision.reason, decision.stop_signal) == (
        Verdict.RESTART, RestartReason.MEMBERSHIP, signal.SIGKILL)  # ranks waiting on dead peers cannot save
    assert decision.failed_peers == FAILED_PEER and decision.lost == ()
    waiting = decide(Observation(state, lost=(), failed_peers=FAILED_PEER))  # it already waits in the next round
    assert waiting.stop_signal == signal.SIGKILL


def test_a_member_whose_workers_failed_comes_before_a_hang_its_peers_show():
    decision = decide(Observation(WorkerState.HEALTHY, overruns=HUNG, failed_peers=FAILED_PEER))
    assert (decision.verdict, decision.stop_signal) == (Verdict.RESTART, signal.SIGKILL)


def test_torchs_own_restart_for_a_joining_node_keeps_sigterm_and_kills_for_a_member_whose_workers_failed():
    """torch restarts a healthy group when nodes wait to join: a newcomer's join lets the workers
    save (SIGTERM); a waiting member whose workers failed leaves ours on dead peers (SIGKILL).
    The reason stays torch's (a failure it charged stays charged)."""
    assert torchs_restart(REPORT, WorkerState.HEALTHY, ()) is REPORT
    assert REPORT.stop_signal == signal.SIGTERM
    for state, reason in ((WorkerState.HEALTHY, RestartReason.MEMBERSHIP), (WorkerState.FAILED,
                                                                             RestartReason.WORKER_FAILED)):
        decision = torchs_restart(REPORT, state, FAILED_PEER)
        assert (decision.stop_signal, restart_reason(decision, state)) == (signal.SIGKILL, reason)
    save = decide(Observation(WorkerState.SUCCEEDED, signal_save=True))
    assert torchs_restart(save, WorkerState.SUCCEEDED, FAILED_PEER) is save  # the monitor's own decision stands


def _failure(local_rank: int, exitcode: int, at: float):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    failure = ProcessFailure(local_rank, 1000 + local_rank, exitcode, "<N/A>")
    failure.timestamp = at
    return failure


def test_only_the_first_failure_decides_whether_a_lost_node_may_explain_it():
    """torch's report lists the workers it stopped after the first failed: SIGKILLed at once now
    (their collectives with the dead rank cannot finish), they are not a crash of their own. A rank
    that exited with an error when a peer node vanished still waits for that node's lease (the demo
    lost its node 1 and gave up: a sibling's -9 was taken for a kill needing no grace)."""
    from elasticft.agent.observe import no_lost_node_explains

    peer_vanished = {0: _failure(0, 1, at=10.0), 1: _failure(1, -signal.SIGKILL, at=10.2)}
    assert not no_lost_node_explains(2, peer_vanished)
    killed_here = {0: _failure(0, -signal.SIGKILL, at=10.0), 1: _failure(1, -signal.SIGKILL, at=10.2)}
    assert no_lost_node_explains(2, killed_here)
    assert no_lost_node_explains(1, peer_vanished)  # a round of one node has no peer node to lose
