"""The etcd key layout of one run: every key eft reads or writes is named here.

All keys live under ``<prefix>/<run_id>/`` (prefix ``/eft`` unless the user sets
``key_prefix`` in ``--rdzv-conf``), so several runs can share one etcd.
"""

from __future__ import annotations

from dataclasses import dataclass

# The rendezvous backend's name: ``--rdzv-backend etcd-v3`` for torchrun and eft-run,
# and the ``torchrun.handlers`` entry point in pyproject.toml.
BACKEND_NAME = "etcd-v3"


@dataclass(frozen=True)
class RunKeys:
    run_id: str
    prefix: str = "/eft"

    @property
    def root(self) -> str:
        return f"{self.prefix.rstrip('/')}/{self.run_id}/"

    @property
    def nodes(self) -> str:
        """Prefix of the per-node records, each held under that node's lease."""
        return self.root + "nodes/"

    def node(self, node_id: str) -> str:
        return self.nodes + node_id

    @property
    def all_health(self) -> str:
        """Prefix of every node's GPU health records."""
        return self.root + "health/"

    def health(self, node_id: str, gpu: int | None = None) -> str:
        base = f"{self.all_health}{node_id}/"
        return base if gpu is None else f"{base}{gpu}"

    @property
    def all_steps(self) -> str:
        """Prefix of every node's current step times (straggler detection)."""
        return self.root + "steps/"

    def steps(self, node_id: str) -> str:
        """One node's ranks and their current step times, held under that node's lease."""
        return self.all_steps + node_id

    @property
    def checkpoints(self) -> str:
        """Prefix of everything the checkpoint protocol writes (request, acks, latest)."""
        return self.root + "ckpt/"

    @property
    def ckpt_request(self) -> str:
        return self.root + "ckpt/request"

    def ckpt_ack(self, request_id: str) -> str:
        return self.ckpt_acks + request_id

    def ckpt_filtered(self, request_id: str) -> str:
        """Marks a risk request the workers skipped (gap rule): it is closed, not saved."""
        return f"{self.root}ckpt/filtered/{request_id}"

    @property
    def ckpt_latest(self) -> str:
        return self.root + "ckpt/latest"

    @property
    def mem_parts(self) -> str:
        """Prefix of the memory checkpoint index: ``<node>`` -> ``contract.memory.NodeParts`` (one key a node)."""
        return self.root + "mem/parts/"

    @property
    def mem_restorable(self) -> str:
        """``contract.memory.Restorable``: the restorable memory iterations, computed by one agent for all."""
        return self.root + "mem/restorable"

    @property
    def mem_plan(self) -> str:
        """``memckpt.plan``: the index's parts of the iterations the live nodes complete, for a restart,
        read and written by the first live node in sorted order, read by every other (zlib'd JSON)."""
        return self.root + "mem/plan"

    def mem_server(self, node_id: str) -> str:
        """``host:port`` of a node agent's shard server (memory checkpoint replicas and restores)."""
        return self.root + "mem/servers/" + node_id

    @property
    def layout(self) -> str:
        return self.root + "layout"

    @property
    def events(self) -> str:
        return self.root + "events/"

    @property
    def ckpt_acks(self) -> str:
        return self.root + "ckpt/ack/"

    @property
    def timeouts(self) -> str:
        """The longest section durations seen so far (--eft-auto-timeouts), merged by every agent."""
        return self.root + "timeouts"

    @property
    def restarts(self) -> str:
        """The job-wide restart record (``contract.restarts.RestartRecord``), updated by every agent (CAS)."""
        return self.root + "restarts"

    @property
    def outcome(self) -> str:
        """How the job ended (``contract.outcome.JobOutcome``), written once per attempt by the
        agent that decides it; ``eft outcome`` turns it into the batch job's exit status."""
        return self.root + "outcome"

    def slurm_end_time(self, attempt: str) -> str:
        """SLURM attempt ``attempt``'s time limit (``contract.end_time.SharedEndTime``), as the one
        agent that asked squeue found it: the others read it instead of asking."""
        return f"{self.root}slurm/{attempt}/end-time"

    def slurm_end_time_asker(self, attempt: str) -> str:
        """Created once (if absent) by the agent that asks squeue for attempt ``attempt``'s end."""
        return f"{self.root}slurm/{attempt}/end-time-asker"

    @property
    def started(self) -> str:
        """When the run started (unix seconds), written once by the first agent."""
        return self.root + "started"

    @property
    def housekeeper(self) -> str:
        """The node that compacts etcd and bounds ``events/`` (elasticft/agent/housekeeping.py),
        held under its lease: when it goes, the next agent to look takes the role."""
        return self.root + "housekeeper"

    @property
    def compaction_floors(self) -> str:
        """Prefix, shared by every run under this key prefix, of the oldest revision each live
        run still reads (its current round's): no run's compaction goes past any of them."""
        return f"{self.prefix.rstrip('/')}/.compaction-floors/"

    @property
    def compaction_floor(self) -> str:
        return self.compaction_floors + self.run_id

    def event(self, name: str) -> str:
        return self.events + name

    @property
    def rdzv_state(self) -> str:
        """The pickled state of torch's dynamic rendezvous: the old blob backend's only key.

        Today's backend never writes it; finding it means an agent of the old backend
        shares this run, which the new one refuses in one line.
        """
        return self.root + "rdzv/state"

    @property
    def rdzv_control(self) -> str:
        """Prefix of the few keys every node in the rendezvous watches: round pointer,
        decisions, closers, waiting markers, held joins, closed."""
        return self.root + "rdzv/ctl/"

    @property
    def rdzv_watched_end(self) -> str:
        """End of the one key range every node watches, [rdzv_control, rdzv_watched_end):
        the control keys and ``rdzv_state`` (nothing else sorts between them: rounds are
        digits, which sort before ``ctl/``), so one watch also sees an old-backend agent."""
        return self.rdzv_state + "\0"

    @property
    def rdzv_round(self) -> str:
        """The round nodes join now (JSON ``{"round": r}``); bumped once per round."""
        return self.rdzv_control + "round"

    @property
    def rdzv_closed(self) -> str:
        """Present once the rendezvous is closed (the job is over): no round forms again."""
        return self.rdzv_control + "closed"

    @property
    def rdzv_decisions(self) -> str:
        """Prefix of the rounds' closing decisions (the last few are kept)."""
        return self.rdzv_control + "decision/"

    def rdzv_decision(self, round_: int) -> str:
        """Round ``round_``'s closing decision, created once by the node that closes it:
        JSON ``{"revision": R, "size": n, "first": <node>}``: its participants are the keys present
        at R; ``first``, the first of them in key order, is rank 0 (it needs no count to know)."""
        return f"{self.rdzv_decisions}{round_}"

    def rdzv_closer(self, round_: int) -> str:
        """The node that closes round ``round_`` (created if absent, under its lease: when it
        dies the key goes and another waiting node takes the role)."""
        return f"{self.rdzv_control}closer/{round_}"

    def rdzv_waiting(self, round_: int) -> str:
        """Present while a node waits in round ``round_`` after round ``round_ - 1`` formed
        (under that node's lease): the members of ``round_ - 1`` watch for it."""
        return f"{self.rdzv_control}waiting/{round_}"

    def rdzv_held(self, round_: int) -> str:
        """Present while the members of round ``round_ - 1`` hold the nodes waiting in round
        ``round_`` until the next checkpoint (``--eft-join-at save``; ``records.JoinHold``), under
        the lease of the member that holds them; deleted when round ``round_`` closes."""
        return f"{self.rdzv_control}held/{round_}"

    @property
    def rdzv_masters(self) -> str:
        """Prefix of the rounds' master addresses (the last few are kept, as decisions are)."""
        return self.rdzv_control + "master/"

    def rdzv_master(self, round_: int) -> str:
        """Where round ``round_``'s rank 0 serves the workers' bootstrap store, written by it under
        its lease once it knows its rank: JSON ``{"addr": a, "port": p}``. The other members learn
        it from the control watch they hold anyway: no read and no watch of their own."""
        return f"{self.rdzv_masters}{round_}"

    @property
    def rdzv_asides(self) -> str:
        """Prefix of the markers of nodes standing aside (``rendezvous/aside.py``)."""
        return self.rdzv_control + "aside/"

    def rdzv_aside(self, node: str) -> str:
        """Present while ``node`` stands aside, under its lease: it reaches etcd but not the
        master of the round it left. JSON ``{"round": r, "master": <node>}``."""
        return self.rdzv_asides + node

    def rdzv_participants(self, round_: int) -> str:
        """Prefix of round ``round_``'s participants, one key per node under that node's lease."""
        return f"{self.root}rdzv/{round_}/p/"

    def rdzv_participant(self, round_: int, node: str) -> str:
        return self.rdzv_participants(round_) + node

    @property
    def c10d(self) -> str:
        """Prefix of the c10d Store that the rendezvous hands to the agents."""
        return self.root + "c10d/"
