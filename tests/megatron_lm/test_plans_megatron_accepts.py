"""Every layout the planner picks is a command line Megatron-LM's own argument checks accept.

The agent rewrites --tensor-model-parallel-size and --pipeline-model-parallel-size at every
re-plan; a layout Megatron refuses would only show in every rank's first seconds, after a
restart. Here each plan, for models of several shapes on many cluster sizes, goes through
megatron.training.arguments' parse_args and validate_args at the plan's world size, in one
subprocess (the CPU emulation answers the device questions validate_args asks).
"""

import json
import subprocess
import sys
from pathlib import Path

from elasticft.planner.layout import NoLegalLayout, plan
from elasticft.planner.megatron_args import model_facts_from_argv, rewrite_megatron_args

COMMON = ["--seq-length", "128", "--max-position-embeddings", "128", "--train-iters", "10", "--lr", "1e-4",
          "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1024", "--transformer-impl", "local",
          "--no-persist-layer-norm", "--ckpt-format", "torch_dist"]
MODELS = {
    "dense": ["--num-layers", "8", "--hidden-size", "256", "--num-attention-heads", "8",
              "--global-batch-size", "48", "--micro-batch-size", "1"],
    "gqa": ["--num-layers", "12", "--hidden-size", "512", "--num-attention-heads", "16", "--group-query-attention",
            "--num-query-groups", "4", "--global-batch-size", "64", "--micro-batch-size", "2"],
    "interleaved": ["--num-layers", "16", "--hidden-size", "256", "--num-attention-heads", "8",
                    "--num-layers-per-virtual-pipeline-stage", "2", "--pipeline-model-parallel-size", "2",
                    "--global-batch-size", "64", "--micro-batch-size", "1"],
    "distributed optimizer, dp_reshardable": [
        "--num-layers", "8", "--hidden-size", "256", "--num-attention-heads", "8", "--global-batch-size", "48",
        "--micro-batch-size", "1", "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
        "--use-distributed-optimizer"],
}
# GPUs per live node: whole clusters of 8-GPU nodes, and the same after losing GPUs or nodes.
CLUSTERS = [[1], [2], [3], [4], [6], [8], [8, 7], [8, 8], [8, 8, 8], [8, 8, 8, 5], [4, 4, 4], [8] * 6, [8] * 16]

CHECK = """
import json, os, sys
sys.path.insert(0, {here!r})
import cpu_emulation
cpu_emulation.enable()
from megatron.training.arguments import parse_args, validate_args
failures = []
for case in json.loads(sys.stdin.read()):
    os.environ["WORLD_SIZE"], os.environ["RANK"] = str(case["world"]), "0"
    sys.argv = ["pretrain_gpt.py", *case["argv"]]
    try:
        validate_args(parse_args(), {{}})
    except BaseException as exc:
        failures.append({{"case": case["name"], "error": f"{{type(exc).__name__}}: {{exc}}"[:300]}})
print(json.dumps(failures))
"""


def test_every_plan_passes_megatrons_parse_args_and_validate_args():
    cases, skipped = [], 0
    for name, model in MODELS.items():
        argv = [*model, *COMMON]
        facts = model_facts_from_argv(argv)
        for nodes in CLUSTERS:
            try:
                chosen = plan(facts.model, facts.batch, nodes, facts.policy)
            except NoLegalLayout:
                skipped += 1
                continue
            cases.append({"name": f"{name} on {nodes}: TP{chosen.tp} PP{chosen.pp} DP{chosen.dp}",
                          "world": chosen.used, "argv": rewrite_megatron_args(argv, chosen)})
    assert len(cases) >= 40, (len(cases), skipped)
    done = subprocess.run([sys.executable, "-c", CHECK.format(here=str(Path(__file__).parent))],
                          input=json.dumps(cases), capture_output=True, text=True, timeout=240,
                          env={"CUDA_DEVICE_MAX_CONNECTIONS": "1", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []
