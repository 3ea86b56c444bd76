"""eft-run in a JobSet, its pods emulated in network namespaces (tests/jobset_pods.py).

What runs is what ``eft kubernetes render`` gives a cluster: the job's own etcd from its
StatefulSet's command, and in every pod the container's bare launch line
(``eft-run --nproc-per-node 1 <script> ...``) with the variables its pod spec sets. The
Job and JobSet controllers' rules come from the same manifest. What the SLURM tests assert
is asserted here: a lost node's pod comes back (same index, new name and address) and the
job takes it back and finishes; no committed checkpoint is lost; the JobSet's outcome
follows eft-run's exit codes.
"""

from __future__ import annotations

import re
import signal

import pytest

from bench.launch import ROOT, wait_for
from bench.netns import unavailable_reason
from elasticft.contract.exit_codes import ExitCode
from elasticft.kubernetes.manifests import ManifestSpec, render
from elasticft.kubernetes.schemas import validate
from tests.jobset_pods import EmulatedJobSet

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

LOOP = ROOT / "examples" / "minimal_train.py"
_ROUND = re.compile(r"rendezvous complete: node rank (\d+) of (\d+), world size (\d+)")


@pytest.fixture(autouse=True)
def _namespaces():
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)


def manifest(*command: str, nodes: int = 2, etcd_members: int = 1) -> list[dict]:
    """A CPU-sized JobSet as the renderer makes it for a cluster (no GPU; one etcd member unless
    asked: three cost the two cores more than what they show once)."""
    spec = ManifestSpec(name="gpt", nodes=nodes, nproc_per_node=1, image="eft:test", gpus_per_node=0,
                        etcd_members=etcd_members, command=[str(part) for part in command])
    objects = render(spec)
    assert validate(objects) == []  # what runs below is a manifest a cluster would take
    return objects


def saved(text: str) -> list[int]:
    return [int(m.group(1)) for m in re.finditer(r"^step (\d+) .*\(saved", text, re.M)]


def starts(text: str) -> list[int]:
    return [int(m.group(1)) for m in re.finditer(r"starting at step (\d+)", text)]


def test_a_lost_pod_is_replaced_at_its_index_and_the_job_takes_it_back_and_completes(tmp_path):
    """The manifest as rendered by default: its etcd a cluster of three members, each started by
    the StatefulSet's own command and finding the others by their names."""
    ckpt = tmp_path / "ckpt"
    objects = manifest(LOOP, "--steps", "300", "--step-seconds", "0.05", "--save", ckpt, etcd_members=3)
    with EmulatedJobSet(objects, tmp_path, slots=6) as jobset:
        jobset.start()
        first, lost = (job.pods[0] for job in jobset.jobs)
        wait_for(lambda: jobset.step() or [s for s in saved(first.launched.output()) if s >= 100], 150,
                 "node 0 to save iteration 100")
        jobset.delete_pod(1)  # its node died: SIGKILL, no save
        committed = max(saved(first.launched.output()))
        assert jobset.wait_outcome(timeout=240) == "Completed", first.launched.output()[-3000:]

        replacement = jobset.jobs[1].pods[-1]
        texts = {pod.name: pod.launched.output() for pod in jobset.pods()}
    assert [p.exit_code for p in jobset.pods()] == [0, 128 + signal.SIGKILL, 0]
    assert replacement.name != lost.name and replacement.slot != lost.slot  # a new pod: new name, new address
    replaced = texts[replacement.name]
    assert f"node id {replacement.name}" in replaced and "--rdzv-endpoint gpt-etcd:2379" in replaced
    # The replacement trained in the same run (its run id) at the job's size, from no older
    # checkpoint than the last one committed before the loss; the job went to its end.
    assert "--rdzv-id k8s-gpt-0f9e8d7c-r0" in replaced
    assert [int(m.group(3)) for m in _ROUND.finditer(replaced)][-1] == 2, replaced[-3000:]
    assert min(starts(texts[first.name])[1:] + starts(replaced)) >= committed
    assert max(saved(texts[first.name]) + saved(replaced)) == 300


def test_a_pod_whose_command_is_wrong_fails_the_jobset_without_replacements(tmp_path):
    """eft-run's 2 (bad input) matches the Job's FailJob rule: a person must look, and no pod
    is replaced over and over (the 100 replacements a lost node may take)."""
    objects = manifest(tmp_path / "no-such-script.py")
    with EmulatedJobSet(objects, tmp_path, slots=3) as jobset:
        jobset.start()
        assert jobset.wait_outcome(timeout=120) == "Failed"
        texts = [pod.launched.output() for pod in jobset.pods()]
    # The first 2 fails the JobSet, which then deletes the pods still running (no exit of theirs).
    codes = [p.exit_code for p in jobset.pods()]
    assert int(ExitCode.USAGE) in codes and set(codes) <= {int(ExitCode.USAGE), None}, texts
    assert all("no-such-script.py" in text for text, code in zip(texts, codes) if code is not None)
    assert len(jobset.pods()) == 2 and jobset.restarts == 0


def test_a_pod_deleted_gracefully_saves_and_every_pod_comes_back_uncounted_to_finish(tmp_path):
    """``kubectl delete pod`` (a drain, a preemption): SIGTERM. eft saves and stops the job
    with 4, which the Job's policy ignores: every pod is replaced without using up its
    backoffLimit, and the new pods resume from that save in the same run."""
    ckpt = tmp_path / "ckpt"
    # 18 s of training left after iteration 20: the delete's save and stop ends the attempt well
    # before on a loaded machine too (with 9 s left, one such CI run trained to the end first)
    objects = manifest(LOOP, "--steps", "200", "--step-seconds", "0.1", "--save", ckpt, "--log-interval", "10")
    with EmulatedJobSet(objects, tmp_path, slots=5) as jobset:
        jobset.start()
        first = jobset.jobs[0].pods[0]
        wait_for(lambda: jobset.step() or "iteration 20 " in first.launched.output(), 150, "iteration 20")
        jobset.delete_pod(1, graceful=True)
        assert jobset.wait_outcome(timeout=240) == "Completed", first.launched.output()[-3000:]
        texts = [pod.launched.output() for pod in jobset.pods()]
    assert [p.exit_code for p in jobset.pods()] == [int(ExitCode.REQUEUE)] * 2 + [0, 0], texts[0][-2000:]
    assert all(job.failures == 0 for job in jobset.jobs)  # Ignore: nothing counted
    [stopped] = {int(m) for text in texts[:2] for m in re.findall(r"^stopped at step (\d+): signal", text, re.M)}
    assert starts(texts[2]) + starts(texts[3]) == [stopped] and 0 < stopped < 200  # (rank 0 says it)
    assert max(saved(texts[2]) + saved(texts[3])) == 200


def test_a_replacement_that_starts_after_the_others_finished_exits_0_and_the_jobset_completes(tmp_path):
    """``--nnodes 2:3``: a pod lost near the end, its replacement held back (an image pull)
    until the two others trained to the end. It finds its job finished and exits 0 at once,
    instead of training again from the last checkpoint or waiting its join timeout for two
    nodes that never come (and being replaced over and over)."""
    ckpt = tmp_path / "ckpt"
    objects = manifest("--nnodes", "2:3", "--rdzv-conf", "join_timeout=60", LOOP, "--steps", "100",
                       "--step-seconds", "0.05", "--save", ckpt, nodes=3)
    with EmulatedJobSet(objects, tmp_path, slots=5) as jobset:
        jobset.hold_replacements = True
        jobset.start()
        first = jobset.jobs[0].pods[0]
        wait_for(lambda: jobset.step() or [s for s in saved(first.launched.output()) if s >= 40], 150,
                 "iteration 40 saved")
        jobset.delete_pod(2)
        wait_for(lambda: jobset.step() or all(job.outcome == "Complete" for job in jobset.jobs[:2]), 180,
                 "the two others to finish")
        jobset.release()
        assert jobset.wait_outcome(timeout=60) == "Completed"
        late = jobset.jobs[2].pods[-1]
        text = late.launched.output()
    assert late.exit_code == 0 and "the training finished" in text and "nothing to do" in text, text[-2000:]
    assert "starting at step" not in text and "rendezvous complete" not in text
    assert max(saved(first.launched.output())) == 100
