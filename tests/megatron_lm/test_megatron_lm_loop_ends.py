"""Where Megatron-LM's loop saves or stops on its own, the ranks vote, also while votes are rare
(``--eft-vote-budget``: k > 1), whatever gave Megatron those iterations: its last iteration from
--train-samples (Megatron computes train_iters), from pretrain()'s args_defaults or from a
--yaml-cfg file (its argparse flags are then ignored), its --exit-interval from args_defaults,
its --non-persistent-save-interval. eft reads them from Megatron's parsed arguments, not from
sys.argv (elasticft/megatron_seam.py: LOOP_ENDS).

Real parts: Megatron's own argument parsing (parse_args, validate_args, the scheduler's
update_train_iters, load_yaml) and eft's loop making its hook (MegatronLoop._make_hook) in one
gloo rank, in a subprocess (the CPU emulation answers validate_args' device questions).
"""

import json
import subprocess
import sys
from pathlib import Path

MODEL = ["--seq-length", "128", "--max-position-embeddings", "128", "--lr", "1e-4", "--mock-data",
         "--tokenizer-type", "NullTokenizer", "--vocab-size", "1024", "--transformer-impl", "local",
         "--no-persist-layer-norm", "--ckpt-format", "torch_dist", "--num-layers", "2", "--hidden-size", "64",
         "--num-attention-heads", "4", "--global-batch-size", "8", "--micro-batch-size", "1"]
YAML = "train_iters: 9\nexit_interval: 4\nckpt_format: torch_dist\nasync_save: false\nload: null\nsave: null\n"

CHECK = """
import json, os, sys
sys.path.insert(0, {here!r})
import cpu_emulation
cpu_emulation.enable()
import torch.distributed as dist
from megatron.training.arguments import parse_args, validate_args
from megatron.training.global_vars import set_args
from megatron.training.training import update_train_iters
from megatron.training.yaml_arguments import load_yaml
from elasticft.megatron_lm.loop import MegatronLoop

os.environ.update(WORLD_SIZE="1", RANK="0", EFT_VOTE_BUDGET="1e-9")  # a vote costs too much: votes are rare
dist.init_process_group("gloo", init_method="file://" + {root!r} + "/init", rank=0, world_size=1)
voted = {{}}
for case in json.loads(sys.stdin.read()):
    os.environ["EFT_RUN_DIR"] = os.path.join({root!r}, case["name"])
    os.makedirs(os.environ["EFT_RUN_DIR"])
    sys.argv = ["pretrain_gpt.py", *case["argv"]]
    if case.get("yaml"):
        args = load_yaml(case["yaml"])  # what parse_args returns for --yaml-cfg
    else:
        args = parse_args()
        validate_args(args, case.get("defaults", {{}}))
        update_train_iters(args)  # setup's scheduler does, before the resume's load
    set_args(args)
    loop = MegatronLoop()
    loop._make_hook()  # as at the resume's load
    voted[case["name"]] = []
    for iteration in range(1, 13):
        before = loop.hook.votes
        loop.hook.step(iteration, loss=2.0)
        if loop.hook.votes > before:
            voted[case["name"]].append(iteration)
print(json.dumps(voted))
"""


def test_the_ranks_vote_where_megatrons_parsed_arguments_say_its_loop_saves_or_stops(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(YAML)
    cases = [
        {"name": "train_samples", "argv": [*MODEL, "--train-samples", "72"]},  # 72 / 8: train_iters 9
        {"name": "args_defaults", "argv": MODEL, "defaults": {"train_iters": 9, "exit_interval": 5}},
        {"name": "non_persistent", "argv": [*MODEL, "--train-iters", "10", "--non-persistent-save-interval", "4"]},
        {"name": "yaml", "argv": ["--yaml-cfg", str(config), "--train-iters", "12"], "yaml": str(config)},
    ]
    done = subprocess.run([sys.executable, "-c", CHECK.format(here=str(Path(__file__).parent), root=str(tmp_path))],
                          input=json.dumps(cases), capture_output=True, text=True, timeout=240,
                          env={"CUDA_DEVICE_MAX_CONNECTIONS": "1", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-3000:]
    voted = json.loads(done.stdout.strip().splitlines()[-1])
    # The first two steps vote (nothing agreed or measured yet), then only where the loop saves or stops.
    assert voted == {
        "train_samples": [1, 2, 9],
        "args_defaults": [1, 2, 5, 9, 10],
        "non_persistent": [1, 2, 4, 8, 10, 12],
        "yaml": [1, 2, 4, 8, 9, 12],  # the file's, not the --train-iters argparse ignores
    }
