"""CheckpointDir: Megatron's layout, keep-K pruning, crashed and corrupt saves never loaded."""

from __future__ import annotations

import logging

import pytest
import torch

from elasticft.worker import CheckpointDir


def save(checkpoints: CheckpointDir, iteration: int, commit: bool = True):
    """One 'rank' saving a real tensor file, then rank 0's commit."""
    path = checkpoints.path_for(iteration)
    torch.save({"iteration": iteration, "weights": torch.arange(4.0) + iteration}, path / "model.pt")
    if commit:
        checkpoints.commit(iteration)
    return path


def load(path, iteration):
    state = torch.load(path / "model.pt")
    assert state["iteration"] == iteration
    return state["weights"]


def test_megatron_layout_and_tracker(tmp_path):
    checkpoints = CheckpointDir(tmp_path)
    path = save(checkpoints, 1500)
    assert path == tmp_path / "iter_0001500"
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "1500"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0001500", "latest_checkpointed_iteration.txt"]
    iteration, weights = checkpoints.load_latest(load)
    assert iteration == 1500 and weights.tolist() == [1500.0, 1501.0, 1502.0, 1503.0]


def test_keeps_the_newest_k_complete_checkpoints(tmp_path):
    checkpoints = CheckpointDir(tmp_path, keep=2)
    for iteration in (100, 200, 300, 400):
        save(checkpoints, iteration)
    assert checkpoints.complete_iterations() == [400, 300]
    assert sorted(p.name for p in tmp_path.glob("iter_*")) == ["iter_0000300", "iter_0000400"]
    checkpoints3 = CheckpointDir(tmp_path / "three", keep=3)
    for iteration in (1, 2, 3, 4, 5):
        save(checkpoints3, iteration)
    assert checkpoints3.complete_iterations() == [5, 4, 3]


def test_a_save_that_dies_halfway_never_becomes_latest(tmp_path):
    checkpoints = CheckpointDir(tmp_path, keep=2)
    save(checkpoints, 100)
    save(checkpoints, 200)
    crashed = save(checkpoints, 300, commit=False)  # a rank died before the commit
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "200"
    assert checkpoints.complete_iterations() == [200, 100]
    assert checkpoints.load_latest(load)[0] == 200
    # The next commit clears the debris and counts only complete saves towards keep.
    save(checkpoints, 400)
    assert not crashed.exists()
    assert checkpoints.complete_iterations() == [400, 200]


def test_saving_again_over_an_old_checkpoint_is_incomplete_until_committed(tmp_path):
    checkpoints = CheckpointDir(tmp_path, keep=3)
    for iteration in (100, 200, 300):
        save(checkpoints, iteration)
    # Training resumed from 200 (say 300 was corrupt) and saves 300 again, and dies.
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("200")
    save(checkpoints, 300, commit=False)
    assert checkpoints.complete_iterations() == [200, 100]
    assert checkpoints.load_latest(load)[0] == 200


def test_a_corrupt_latest_falls_back_to_the_previous_with_a_warning(tmp_path, caplog):
    checkpoints = CheckpointDir(tmp_path, keep=3)
    for iteration in (100, 200, 300):
        save(checkpoints, iteration)
    model = tmp_path / "iter_0000300" / "model.pt"
    model.write_bytes(model.read_bytes()[:40])  # torn by a failing disk

    with caplog.at_level(logging.WARNING):
        iteration, weights = checkpoints.load_latest(load)

    assert iteration == 200 and weights.tolist() == [200.0, 201.0, 202.0, 203.0]
    assert "could not load checkpoint" in caplog.text and "iter_0000300" in caplog.text


def test_a_tracker_naming_an_unfinished_save_falls_back(tmp_path, caplog):
    checkpoints = CheckpointDir(tmp_path)
    save(checkpoints, 100)
    save(checkpoints, 200, commit=False)
    # Something else (Megatron's own saver) moved the tracker before the save was marked.
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("200")
    with caplog.at_level(logging.WARNING):
        assert checkpoints.load_latest(load)[0] == 100
    assert "not marked complete" in caplog.text


def test_an_unreadable_tracker_falls_back_to_the_newest_complete_one(tmp_path, caplog):
    checkpoints = CheckpointDir(tmp_path, keep=3)
    for iteration in (100, 200):
        save(checkpoints, iteration)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("release")
    with caplog.at_level(logging.WARNING):
        assert checkpoints.load_latest(load)[0] == 200
    assert "not an iteration" in caplog.text


def test_nothing_to_load(tmp_path):
    calls = []
    assert CheckpointDir(tmp_path / "absent").load_latest(lambda p, i: calls.append(i)) == (None, None)
    checkpoints = CheckpointDir(tmp_path)
    save(checkpoints, 100, commit=False)
    assert checkpoints.load_latest(lambda p, i: calls.append(i)) == (None, None)
    assert calls == []


def test_keep_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="keep"):
        CheckpointDir(tmp_path, keep=0)


def test_where_another_rank_could_not_load_the_latest_every_rank_takes_the_one_before(tmp_path):
    """megatron-core 0.19 loads each rank's part without a collective: a rank whose own load of
    the latest went through still falls back with the others (``agree``: the MAX over the ranks,
    here the answer of a job in which another rank failed once)."""
    checkpoints = CheckpointDir(tmp_path, keep=2)
    save(checkpoints, 100)
    save(checkpoints, 200)
    answers = iter([[1], [0]])  # the latest failed elsewhere; the one before loaded everywhere
    loaded = []
    iteration, weights = checkpoints.load_latest(lambda p, i: loaded.append(i) or load(p, i),
                                                 agree=lambda mine: next(answers))
    assert loaded == [200, 100]  # this rank loaded both: the second load's state is what it keeps
    assert iteration == 100 and weights.tolist() == [100.0, 101.0, 102.0, 103.0]
