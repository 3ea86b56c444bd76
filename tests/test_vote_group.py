"""The vote's process group (elasticft/worker/vote_group.py) on real gloo ranks: a rank opens a
connection only to the peers the vote's tree and the group's gathers talk to, not to every other
rank, and the vote and ``all_gather_object`` on it still agree; a user's ``Hook()`` on a job whose
default group is not gloo votes on such a group, not on the training's backend.

The ranks are forked by a fresh interpreter (tests/vote_group_ranks.py), so pytest's threads are
never forked.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RANKS = 16
# Each rank's listener, its tree neighbours (parent and children: at most ⌈log2 N⌉) and the one
# ring neighbour of gloo's allgather that is not among them.
BOUND = math.ceil(math.log2(RANKS)) + 2


def ranks(mode: str, tmp_path: Path) -> list[dict]:
    done = subprocess.run([sys.executable, "-m", "tests.vote_group_ranks", mode, str(RANKS), str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(RANKS)]


def test_the_vote_group_connects_each_rank_to_its_tree_not_to_every_rank(tmp_path):
    """The Megatron loops' group: making it, three votes and an all_gather_object open at most
    ⌈log2 N⌉ + 2 sockets per rank, where a plain gloo group opens one per other rank."""
    results = ranks("vote", tmp_path)
    assert max(r["gathered"] for r in results) <= BOUND, [r["gathered"] for r in results]
    assert min(r["eager"] for r in results) >= RANKS - 1  # the same ranks' full mesh, for contrast
    for rank, result in enumerate(results):
        assert result["backend"] == "gloo"
        # A request one rank's agent relayed at iteration 2: every rank saves there, and only there.
        assert result["actions"] == [[1, False, None], [2, True, "manual"], [3, False, None]], rank
        assert result["agreed"] == [RANKS - 1, 7]  # agree(): the MAX over the ranks
        assert result["everyone"] == [{"rank": r} for r in range(RANKS)]


def test_a_users_hook_on_a_job_whose_default_group_is_not_gloo_votes_on_a_gloo_group_of_its_own(tmp_path):
    """On an NCCL job a vote on the default group is a CUDA all_reduce and a host sync per vote.
    Here the default group is a backend registered under another name (gloo underneath, counting
    what it carries): the Hook, given no group, puts no message of its votes on it."""
    results = ranks("counted", tmp_path)
    for rank, result in enumerate(results):
        assert result["world_ops"] == 0, (rank, result["world_ops"])
        assert result["own_group"] and result["backend"] == "gloo"
        assert result["actions"] == [[1, False, None], [2, True, "manual"], [3, False, None]], rank
        assert result["agreed"] == [RANKS - 1, 7]
    assert max(r["voted"] for r in results) <= BOUND
