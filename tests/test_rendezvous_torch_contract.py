"""torch's rendezvous-handler tests, as behaviours, against eft's etcd-v3 handler and torch's c10d one.

Every case runs twice: ``eft`` (``EtcdRendezvousHandler`` on the session's real etcd) and
``c10d`` (torch's ``DynamicRendezvousHandler`` on a real TCPStore), both built by torch's
``rendezvous_handler_registry`` as torchrun builds them, driven by real threads; a
difference between the two is a failure. Cases read from pytorch/pytorch
``test/distributed/elastic/rendezvous/`` (an index's recent versions, not pinned to the
v2.13.0 tag); the c10d side runs the installed torch 2.13.0. Kept different on purpose:
eft's default last call (1 s, torch 30 s), and eft's is_closed is current at once where
torch's answers from a state cached for a second (the cases await it).

Covered here (torch case -> test here):
  dynamic_rendezvous_test IntegrationTest.test_all_nodes_join_rendezvous -> all_nodes_join...
  .. IntegrationTest.test_redundancy_list -> a_node_beyond_max_is_redundant...
  .. IntegrationTest.test_redundancy_transition_to_wait_list_then_join_rendezvous -> a_redundant_node_joins...
  .. IntegrationTest.test_use_agent_store_is_true_by_default / _is_disabled -> use_agent_store...
  .. IntegrationTest.test_share_tcp_store_from_backend (real stores, no mocks) -> rank0_hosts_the_bootstrap_store...
  .. IntegrationTest.test_share_tcp_store_is_disabled -> use_agent_store... (ranks agree on the address)
  .. (no torch case) a late node's bootstrap store -> a_node_first_joining_a_later_round... (xfail on c10d: a torch bug)
  .. DynamicRendezvousHandlerTest.test_share_store_creates_tcp_store -> next_rendezvous_again...
  .. .test_next_rendezvous_returns_expected_value -> the_round_store_is_prefixed...
  .. .test_next_rendezvous_respects_the_requested_timeout -> too_few_nodes_time_out...
  .. .test_next_rendezvous_moves_to_next_round_if_called_repeatedly -> next_rendezvous_again...
  .. .test_is_closed_returns_expected_value, .test_set_closed_closes_rendezvous,
     .test_set_closed_can_be_called_multiple_times -> is_closed_is_false_until...
  .. .test_is_closed_records_and_raises_exceptions (the raising) -> when_the_store_is_gone...
  .. .test_shutdown_closes_rendezvous_and_returns_true, .test_shutdown_can_be_called_multiple_times
     -> shutdown_closes...
  .. .test_shutdown_returns_false_if_rendezvous_cannot_be_closed -> when_the_store_is_gone...
  .. .test_num_nodes_waiting_returns_expected_value -> a_late_node_is_counted_waiting...
  .. TestRendezvousJoinOp (its outcomes, not its actions): max completes at once, min after the
     last call, timeout, closed -> error, wait list / redundancy list -> the integration tests here
  .. TestRendezvousJoinOp closed-while-redundant (RendezvousGracefulExitError) -> closing_lets_a_redundant...
  .. DynamicRendezvousHandlerFromBackendTest.test_init_* , CreateHandlerTest.test_create_handler_returns_handler*
     -> settings_carry... / settings_default...; min < 1, max < min -> bad_node_counts...
  .. CreateHandlerTest.test_create_handler_rdzv_local_addr -> local_addr_is_the_bootstrap_address...
  .. RendezvousTimeoutTest.test_init_raises_error_if_timeout_is_not_positive -> bad_timeouts...
  api_test RendezvousHandlerRegistryTest.test_create_handler_returns_handler (+ its backend-name
     sanity check) -> the_registry_builds...; RendezvousParametersTest min/max errors -> bad_node_counts...
  etcd_rendezvous_test (basic params, run id, get_backend) -> the_registry_builds...
  etcd_rendezvous_backend_test / c10d_rendezvous_backend_test CreateBackendTest unreachable
     -> an_unreachable_endpoint...; read_timeout not positive -> bad_timeouts...
  static_rendezvous_test test_get_backend, test_static_rdzv_multiple_calls -> the_registry_builds...,
     next_rendezvous_again...; test_missing_port/test_empty_endpoint -> an_endpoint_without_a_port (eft)
  out_of_tree_rendezvous_test (torchrun.handlers entry point) -> the_registry_builds... (never registered by hand)

Do not apply (why):
  dynamic_rendezvous_test BackendRendezvousStateHolderTest (all): torch's _BackendRendezvousStateHolder
     syncing/caching/sanitizing a pickled state; eft keeps no pickled state (one key per node).
  .. RendezvousStateTest: the size of the pickled _RendezvousState; eft has none.
  .. DistributedRendezvousOpExecutorTest (all), TestRendezvousExitOp/JoinOp/CloseOp/KeepAliveOp
     (the actions): torch's private state machine run on a fake state holder with mocks.
  .. NodeDescTest, NodeDescGeneratorTest: torch's private _NodeDesc (eft names nodes the same way).
  .. DynamicRendezvousHandlerTest.test_share_store_when_tcp_store: mocks PrefixStore/TCPStore internals.
  .. .test_next_rendezvous_skews_the_first_join_attempt: private _delay against CAS contention;
     eft writes one key per node without contention, so it does not skew.
  .. .test_set_closed_respects_the_requested_timeout: eft's close is one etcd put bounded by the
     etcd request timeout; close_timeout is only reported in settings.
  .. .test_*_records_and_raises_exceptions (the recording), .test_shutdown_records_and_raises_exceptions,
     CreateHandlerTest.test_create_handler_records_and_raises_exceptions: torch's rdzv event
     recording through mocks; eft records its own event log.
  .. .test_num_nodes_waiting_records_and_raises_exceptions: deliberately different: eft answers
     num_nodes_waiting from its watches and does not raise while etcd is away (an etcd outage is
     not a node failure, DESIGN.md).
  .. .test_keep_alive_* (5): torch's heartbeat thread; eft's liveness is an etcd lease (no heartbeat
     writes). A lost member is covered here (a_redundant_node_joins...) and by test_rendezvous_keys (kill -9).
  default_rendezvous_test: a module torch no longer ships.
  rendezvous_backend_test, filestore_rendezvous_backend_test, TCPStoreBackendTest, FileStoreBackendTest,
     EtcdRendezvousBackendTest:
     RendezvousBackend.get_state/set_state of a pickled state; eft has no RendezvousBackend.
  c10d/etcd CreateBackendTest store_type, is_host, file store, mkstemp, protocol, v2 key layout:
     options of those backends; eft's are checked by its --rdzv-conf parser.
  etcd_rendezvous_backend_test.test_get_waits_for_store_prefix_key: a Store behaviour, in
     tests/test_store_contract.py.
  api_test RendezvousParametersTest (get/get_as_bool/get_as_int), the rest of RendezvousHandlerRegistryTest,
     utils_test (config/endpoint parsing, hostname matching, _PeriodicTimer): torch's own helpers, used
     unchanged by eft, not handler behaviour. etcd_server_test, etcd_find_free_port_test: torch's v2 etcd server.
"""

from __future__ import annotations

import time
import uuid
from datetime import timedelta

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousGracefulExitError,
    RendezvousTimeoutError,
)

from bench.launch import wait_for
from elasticft.rendezvous.handler import EtcdRendezvousHandler
from elasticft.store import EmbeddedEtcd, free_port
from tests.rdzv_subjects import (
    SUBJECTS,
    Run,
    assert_one_world,
    bootstrap_of,
    c10d_store,
    c10d_subject,
    eft_subject,
    in_thread,
    join_all,
    raises,
    reach,
)

pytestmark = pytest.mark.seam  # torch's own contract: the lanes of other torches run it

# torch's c10d handler builds the bootstrap store info once per handler: a node whose first
# round is not round 0 waits for MASTER_ADDR under the new round's prefix, which the rank 0
# that already hosts a server never writes (DistStoreError after read_timeout).
TORCH_LATE_BOOTSTRAP = "torch c10d: a node that first joins a later round never gets the bootstrap address"
# torch's handler polls its state once a second: a case with several rounds or a lost member takes it
# 3-7 s, so those cases run on c10d only in the slow suite
SLOW_ON_C10D = pytest.mark.parametrize("subject", ["eft", pytest.param("c10d", marks=pytest.mark.slow)],
                                       indirect=True)


@pytest.fixture(params=SUBJECTS)
def subject(request):
    if request.param == "eft":
        yield eft_subject(request.getfixturevalue("etcd_server"), request.getfixturevalue("etcd"))
        return
    store = c10d_store()
    yield c10d_subject(store)
    del store


@pytest.fixture
def run(subject):
    made = Run(subject)
    yield made
    made.close()


def xfail_for(request, run, name: str, reason: str) -> None:
    if run.subject.name == name:
        request.applymarker(pytest.mark.xfail(strict=True, reason=reason))


# -- the handler from its parameters -------------------------------------------------------------


def test_the_registry_builds_the_handler_with_its_backend_name_and_run_id(run):
    handler = run.handler(1, 1)
    assert handler.get_backend() == run.subject.backend  # else the registry itself raises
    assert handler.get_run_id() == run.run_id == handler.settings.run_id
    if run.subject.name == "eft":
        assert isinstance(handler, EtcdRendezvousHandler)


def test_settings_carry_min_max_nodes_and_the_given_timeouts(run):
    handler = run.handler(3, 6, join_timeout="50", last_call_timeout="60", close_timeout="70")
    settings = handler.settings
    assert (settings.min_nodes, settings.max_nodes) == (3, 6)
    assert settings.timeout.join == timedelta(seconds=50)
    assert settings.timeout.last_call == timedelta(seconds=60)
    assert settings.timeout.close == timedelta(seconds=70)


def test_settings_default_timeouts_when_none_are_given(run):
    handler = run.handler(1, 2, join_timeout=None, last_call_timeout=None)
    assert handler.settings.timeout.join == timedelta(seconds=600)
    assert handler.settings.timeout.close == timedelta(seconds=30)
    assert handler.settings.timeout.last_call == timedelta(seconds=run.subject.default_last_call)


@pytest.mark.parametrize("value", ["0", "-10", "abc"])
@pytest.mark.parametrize("option", ["join_timeout", "last_call_timeout"])
def test_bad_timeouts_are_a_value_error(run, option, value):
    with pytest.raises(ValueError):
        run.handler(1, 1, **{option: value})


@pytest.mark.parametrize("nodes", [(0, 1), (-1, 2), (3, 2)])
def test_bad_node_counts_are_a_value_error(subject, nodes):
    with pytest.raises(ValueError, match="number of rendezvous nodes"):
        subject.params(uuid.uuid4().hex, *nodes)


def test_an_unreachable_endpoint_is_a_rendezvous_connection_error(run):
    conf = {"etcd_timeout": "1"} if run.subject.name == "eft" else {"read_timeout": "1"}
    began = time.monotonic()
    with pytest.raises(RendezvousConnectionError):
        run.handler(1, 1, endpoint=f"127.0.0.1:{free_port()}", join_timeout="1", **conf)
    assert time.monotonic() - began < 10


@pytest.mark.parametrize("subject", ["eft"], indirect=True)  # c10d falls back to its default port 29400
def test_an_endpoint_without_a_port_is_a_value_error(run):
    with pytest.raises(ValueError):
        run.handler(1, 1, endpoint="localhost")


# -- next_rendezvous -------------------------------------------------------------------------------


def test_all_nodes_join_with_distinct_ranks_one_world_size_and_none_waiting(run):
    handlers = run.handlers(2, 2, 2)
    infos = join_all(handlers)
    assert_one_world(infos, 2)
    assert [h.num_nodes_waiting() for h in handlers] == [0, 0]


def test_max_nodes_form_a_round_at_once_without_the_last_call(run):
    began = time.monotonic()
    assert_one_world(join_all(run.handlers(3, 2, 3, last_call_timeout="20")), 3)
    assert time.monotonic() - began < 10


def test_min_nodes_form_a_round_after_the_last_call(run):
    began = time.monotonic()
    assert_one_world(join_all(run.handlers(2, 2, 4, last_call_timeout="1")), 2)
    assert time.monotonic() - began >= 1.0


def test_too_few_nodes_time_out_at_the_join_timeout(run):
    handler = run.handler(2, 2, join_timeout="1")
    began = time.monotonic()
    with pytest.raises(RendezvousTimeoutError):
        handler.next_rendezvous()
    assert 1.0 <= time.monotonic() - began < 8


def test_the_round_store_is_shared_and_prefixed_by_run_id_and_round(run):
    infos = sorted(join_all(run.handlers(2, 2, 2)), key=lambda i: i.rank)
    infos[0].store.set("hello", b"world")
    assert infos[1].store.get("hello") == b"world"
    assert infos[1].store.underlying_store.get(f"torch.rendezvous.{run.run_id}.0/hello") == b"world"


def test_next_rendezvous_again_starts_a_new_round_with_a_fresh_store(run):
    handler = run.handler(1, 1)
    infos = []
    for number in range(3):
        infos.append(handler.next_rendezvous())
        assert (infos[-1].rank, infos[-1].world_size) == (0, 1)
        assert not infos[-1].store.check(["key"])  # nothing of the rounds before
        infos[-1].store.set("key", str(number))
    for number, info in enumerate(infos):
        assert info.store.underlying_store.get(f"torch.rendezvous.{run.run_id}.{number}/key") == str(number).encode()
    # torch's rank 0 keeps hosting one server; eft's hosts a new one every round, or the next
    # generation of workers would read the gloo addresses of the last (issue 22's node-loss bench)
    assert len({bootstrap_of(i) for i in infos}) == (3 if run.subject.name == "eft" else 1)


# -- the workers' bootstrap store -------------------------------------------------------------------


def test_rank0_hosts_the_bootstrap_store_every_rank_reaches(run):
    infos = join_all(run.handlers(2, 2, 2))
    assert all(h.use_agent_store for h in run.made)
    addresses = {bootstrap_of(i) for i in infos}
    assert len(addresses) == 1
    assert reach(*addresses.pop()) == b"yes"


@SLOW_ON_C10D
def test_a_node_first_joining_a_later_round_gets_that_rounds_bootstrap_store(run, request):
    xfail_for(request, run, "c10d", TORCH_LATE_BOOTSTRAP)
    members = run.handlers(2, 2, 3, read_timeout=None if run.subject.name == "eft" else "2")
    join_all(members)
    late = in_thread(run.handler(2, 3, read_timeout=None if run.subject.name == "eft" else "2").next_rendezvous)
    wait_for(lambda: members[0].num_nodes_waiting() == 1, 15, "members to count the late node")
    infos = [f.result(timeout=30) for f in [in_thread(m.next_rendezvous) for m in members] + [late]]
    addresses = {bootstrap_of(i) for i in infos}
    assert len(addresses) == 1
    assert reach(*addresses.pop()) == b"yes"


def test_use_agent_store_is_off_with_torch_disable_share_and_ranks_still_agree(run, monkeypatch):
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    infos = join_all(run.handlers(2, 2, 2))
    assert not any(h.use_agent_store for h in run.made)
    assert len({bootstrap_of(i) for i in infos}) == 1


def test_local_addr_is_the_bootstrap_address_of_rank0(run):
    info = run.handler(1, 1, local_addr="127.0.0.2").next_rendezvous()
    assert info.bootstrap_store_info.master_addr == "127.0.0.2"
    assert reach("127.0.0.2", info.bootstrap_store_info.master_port) == b"yes"


# -- num_nodes_waiting and the redundancy list -----------------------------------------------------


@SLOW_ON_C10D
def test_a_late_node_is_counted_waiting_and_joins_the_next_round(run, monkeypatch):
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # membership only: see TORCH_LATE_BOOTSTRAP
    # the late node polls once a second (c10d): a last call shorter than that may close round 1 without it
    members = run.handlers(2, 2, 3, last_call_timeout="3")
    join_all(members)
    late = in_thread(run.handler(2, 3, last_call_timeout="3").next_rendezvous)
    wait_for(lambda: [m.num_nodes_waiting() for m in members] == [1, 1], 15, "members to count the late node")
    assert_one_world(join_all(members) + [late.result(timeout=30)], 3)


def test_a_node_beyond_max_is_redundant_and_not_counted_waiting(run):
    members = run.handlers(2, 2, 2)
    join_all(members)
    spare = in_thread(run.handler(2, 2).next_rendezvous)
    wait_for(lambda: run.subject.probe.spare_registered(run.run_id, members[0]), 15, "the spare to register")
    assert [m.num_nodes_waiting() for m in members] == [0, 0]
    assert not spare.done()


@SLOW_ON_C10D
def test_a_redundant_node_joins_once_a_member_is_gone(run, monkeypatch):
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # membership only: see TORCH_LATE_BOOTSTRAP
    # at min 1 a short last call lets the first in round 1 close it alone (c10d, loaded); max closes it at once
    members = run.handlers(2, 1, 2, last_call_timeout="10")
    join_all(members)
    spare = in_thread(run.handler(1, 2, last_call_timeout="10").next_rendezvous)
    wait_for(lambda: run.subject.probe.spare_registered(run.run_id, members[0]), 15, "the spare to register")
    run.subject.probe.lose(members[1])
    wait_for(lambda: members[0].num_nodes_waiting() > 0, 15, "the member to see the loss")
    assert_one_world([members[0].next_rendezvous(), spare.result(timeout=30)], 2)


# -- closing -----------------------------------------------------------------------------------------


def test_is_closed_is_false_until_set_closed_then_true_for_every_node(run):
    members = run.handlers(2, 2, 2)
    join_all(members)
    assert [m.is_closed() for m in members] == [False, False]
    members[0].set_closed()
    members[0].set_closed()  # twice is fine
    assert members[0].is_closed()
    # torch's handler answers from a state it caches for a second: the others see it soon, not at once
    wait_for(members[1].is_closed, 5, "the other member to see the rendezvous closed")
    assert run.handler(2, 2).is_closed()  # a node that comes later sees it too


def test_shutdown_closes_the_rendezvous_and_returns_true_each_time(run):
    members = run.handlers(2, 2, 2)
    join_all(members)
    assert members[0].shutdown() is True
    assert members[0].shutdown() is True
    wait_for(members[1].is_closed, 5, "the other member to see the rendezvous closed")


def test_a_closed_rendezvous_refuses_next_rendezvous(run):
    run.handler(1, 1).set_closed()
    with pytest.raises(RendezvousClosedError):
        run.handler(1, 1).next_rendezvous()


def test_closing_ends_the_wait_of_a_node_waiting_for_the_first_round(run):
    waiter = in_thread(run.handler(2, 2).next_rendezvous)
    wait_for(lambda: run.subject.probe.first_round_size(run.run_id) == 1, 15, "the waiter to join round 0")
    run.handler(2, 2).set_closed()
    with pytest.raises(RendezvousClosedError):
        waiter.result(timeout=15)


@SLOW_ON_C10D
def test_closing_ends_the_wait_of_a_late_node(run):
    members = run.handlers(2, 2, 3)
    join_all(members)
    late = in_thread(run.handler(2, 3).next_rendezvous)
    wait_for(lambda: members[0].num_nodes_waiting() == 1, 15, "the late node to be counted")
    assert members[0].shutdown() is True
    with pytest.raises(RendezvousClosedError):
        late.result(timeout=15)


def test_closing_lets_a_redundant_node_exit_gracefully(run):
    members = run.handlers(2, 2, 2)
    join_all(members)
    spare = in_thread(run.handler(2, 2).next_rendezvous)
    wait_for(lambda: run.subject.probe.spare_registered(run.run_id, members[0]), 15, "the spare to register")
    members[0].shutdown()
    with pytest.raises(RendezvousGracefulExitError):
        spare.result(timeout=15)


# -- when the store is gone ----------------------------------------------------------------------------


def test_when_the_store_is_gone_shutdown_returns_false_and_is_closed_raises_a_connection_error(run):
    if run.subject.name == "eft":
        server = EmbeddedEtcd().start()
        endpoint, stop, conf = server.endpoint, server.stop, {"etcd_timeout": "1"}
    else:
        own = [dist.TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True)]
        endpoint, stop, conf = f"127.0.0.1:{own[0].port}", own.clear, {}
    try:
        handler = run.handler(1, 1, endpoint=endpoint, **conf)
        handler.next_rendezvous()
    finally:
        stop()
    assert handler.shutdown() is False
    # torch's handler may answer is_closed from its one-second cache first
    wait_for(lambda: raises(handler.is_closed, RendezvousConnectionError), 5, "is_closed to raise")
