"""Segments (``--eft-segment``): a round takes whole segments of one domain, so a spare replaces a
lost node of its own domain, and where the domain has none the job goes on without that segment.

The rule is checked pure, then on real etcd with eft's handlers (torch's registry builds them,
real threads join): two domains of two members and a spare each. The domain comes from NVML's
GPU fabric information, faked at the pynvml call level (``bench/fake_pynvml.py``).
"""

from __future__ import annotations

import pytest

from bench.fake_pynvml import FakeGpu, FakeNvml
from bench.launch import wait_for
from elasticft.health.fabric import nvlink_domain
from elasticft.rendezvous.backend import use_segments
from elasticft.rendezvous.decision import SegmentRule
from elasticft.rendezvous.segments import Candidate, choose, size_with
from tests.rdzv_subjects import Run, eft_subject, in_thread

RACK_A = "0b9a3c1e-0000-4000-8000-00000000000a"
RACK_B = "0b9a3c1e-0000-4000-8000-00000000000b"


# -- the rule ---------------------------------------------------------------------------------------

def test_a_round_takes_whole_segments_of_one_domain_up_to_the_maximum():
    found = [Candidate(n, d) for n, d in [("a1", "A"), ("a2", "A"), ("a3", "A"), ("b1", "B"), ("b2", "B"),
                                          ("c1", "C")]]
    assert choose(found, 0, max_nodes=4, per_segment=2) == ["a1", "a2", "b1", "b2"]  # c1 makes no segment
    assert choose(found, 0, max_nodes=6, per_segment=2) == ["a1", "a2", "b1", "b2"]
    assert choose(found, 0, max_nodes=6, per_segment=3) == ["a1", "a2", "a3"]
    assert choose(found, 0, max_nodes=2, per_segment=1) == ["a1", "a2"]


def test_the_members_of_the_round_before_stay_and_the_spare_of_the_lost_nodes_domain_comes_in():
    # round 0 took a1 a2 b1 b2; a1 was lost; a3 and b3 waited as spares
    found = [Candidate("a3", "A", 0), Candidate("a4", "A", -1), Candidate("b1", "B", 0), Candidate("b2", "B", 0),
             Candidate("b0", "B", -1)]
    assert choose(found, 1, max_nodes=4, per_segment=2) == ["a3", "a4", "b1", "b2"]  # b0 sorts first: not taken
    # the members' domain keeps its place against a domain of newcomers
    fresh = [Candidate("b1", "B", 0), Candidate("b2", "B", 0), Candidate("a1", "A"), Candidate("a2", "A")]
    assert choose(fresh, 1, max_nodes=2, per_segment=2) == ["b1", "b2"]


def test_nodes_that_make_no_whole_segment_with_the_members_restart_no_one():
    assert size_with({"B": 2}, ["A", "B"], max_nodes=4, per_segment=2) == 2  # A alone, B one over
    assert size_with({"B": 2}, ["A", "A"], max_nodes=4, per_segment=2) == 4  # A makes a segment again
    assert size_with({"A": 2, "B": 2}, ["A", "A"], max_nodes=4, per_segment=2) == 4  # full


# -- the domain from NVML ---------------------------------------------------------------------------

def _gpus(*fabrics):
    return [FakeGpu(i, f"GPU-{i:08x}-1111-2222-3333-{i:012x}", fabric=f) for i, f in enumerate(fabrics)]


def test_the_domain_is_the_fabric_cluster_and_clique_every_gpu_of_the_node_shares(monkeypatch):
    fake = FakeNvml(_gpus((RACK_A, 3), (RACK_A, 3))).install(monkeypatch)
    assert nvlink_domain(visible_devices=None) == f"{RACK_A}/3"
    assert not fake.initialised  # NVML is shut down again
    FakeNvml(_gpus((RACK_A, 3), (RACK_A, 3), (RACK_B, 3))).install(monkeypatch)
    assert nvlink_domain(visible_devices="0,1") == f"{RACK_A}/3"  # the workers' GPUs only
    assert nvlink_domain(visible_devices=None) is None  # split across two domains: in none


def test_no_fabric_information_is_no_domain(monkeypatch):
    import pynvml

    FakeNvml(_gpus(None, None)).install(monkeypatch)  # no NVSwitch domain: NotSupported
    assert nvlink_domain(visible_devices=None) is None
    fake = FakeNvml(_gpus((RACK_A, 0), (RACK_A, 0))).install(monkeypatch)
    fake.gpus[1].fabric_state = pynvml.NVML_GPU_FABRIC_STATE_IN_PROGRESS  # still registering
    assert nvlink_domain(visible_devices=None) is None
    FakeNvml(init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED).install(monkeypatch)
    assert nvlink_domain(visible_devices=None) is None


@pytest.mark.parametrize("flags, says", [
    (["--eft-segment", "2", "--nnodes", "3:4"], "--eft-segment 2: --nnodes 3:4 must be whole segments"),
    (["--eft-segment", "2", "--nnodes", "2:4"], "--eft-segment 2: this node's GPUs report no NVLink domain"),
    (["--eft-segment", "2", "--nnodes", "2", "--eft-segment-domain", "a b"], "--eft-segment-domain: expected"),
    (["--eft-segment", "-1"], "--eft-segment: expected >= 0"),
])
def test_a_segment_mistake_is_one_line_before_anything_starts(flags, says, tmp_path, monkeypatch, capfd):
    from launcher.eft_run import main

    (tmp_path / "train.py").write_text("")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as ended:
        main(["--rdzv-backend", "etcd-v3", "--rdzv-endpoint", "127.0.0.1:1", *flags, "train.py"])
    err = capfd.readouterr().err
    assert ended.value.code == 2, err
    assert says in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err


# -- rounds on etcd ---------------------------------------------------------------------------------

@pytest.fixture
def run(etcd_server, etcd):
    made = Run(eft_subject(etcd_server, etcd))
    yield made
    made.close()


def _node(run, domain: str, min_nodes: int = 2):
    handler = run.handler(min_nodes, 4)
    use_segments(handler, SegmentRule(2, domain))
    return handler


def test_a_loss_takes_its_own_domains_spare_and_a_domain_without_one_drops_out(run, etcd):
    nodes = {name: _node(run, name[0]) for name in ("a1", "a2", "as", "b1", "b2", "bs")}
    joined = {name: in_thread(h.next_rendezvous) for name, h in nodes.items()}
    wait_for(lambda: sum(f.done() for f in joined.values()) == 4, 30, "round 0 to form")
    first = {name: f.result() for name, f in joined.items() if f.done()}
    spares = sorted(set(nodes) - set(first))
    assert len(spares) == 2 and {s[0] for s in spares} == {"a", "b"}  # one left out of each domain
    assert {i.world_size for i in first.values()} == {4} and sorted(i.rank for i in first.values()) == [0, 1, 2, 3]
    assert all(nodes[n].num_nodes_waiting() == 0 for n in first)  # spares left out restart no one

    # a member of domain A is lost: the survivors restart into A's spare, B's stays out
    lost_a = min(n for n in first if n[0] == "a")
    run.subject.probe.lose(nodes[lost_a])
    survivors = [n for n in first if n != lost_a]
    wait_for(lambda: all(nodes[n].num_nodes_waiting() > 0 for n in survivors), 30, "the survivors to see the loss")
    again = {n: in_thread(nodes[n].next_rendezvous) for n in survivors}
    spare_a, spare_b = (next(s for s in spares if s[0] == d) for d in "ab")
    second = {n: f.result(timeout=30) for n, f in again.items()} | {spare_a: joined[spare_a].result(timeout=30)}
    assert {i.world_size for i in second.values()} == {4}
    assert sorted(i.rank for i in second.values()) == [0, 1, 2, 3]
    assert not joined[spare_b].done()  # B lost no one: its spare waits on
    assert all(second[n].rank == first[n].rank for n in survivors)  # the survivors keep their ranks,
    assert second[spare_a].rank == first[lost_a].rank  # the spare takes the lost node's

    # a second loss in A, which has no spare left: the round is B's segment alone
    lost_again = next(n for n in second if n[0] == "a")
    run.subject.probe.lose(nodes[lost_again])
    members = [n for n in second if n != lost_again]
    wait_for(lambda: all(nodes[n].num_nodes_waiting() > 0 for n in members), 30, "the members to see the loss")
    third = {n: in_thread(nodes[n].next_rendezvous) for n in members}
    left_a = next(n for n in members if n[0] == "a")
    taken = {n: f.result(timeout=30) for n, f in third.items() if n[0] == "b"}
    assert {i.world_size for i in taken.values()} == {2} and sorted(i.rank for i in taken.values()) == [0, 1]
    assert not third[left_a].done() and not joined[spare_b].done()  # A's last node and B's spare wait as spares
    assert all(nodes[n].num_nodes_waiting() == 0 for n in taken)  # and restart no one
