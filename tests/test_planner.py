"""The parallelism planner, its Megatron argument handling and `eft plan`.

Legality is checked by ``planner_oracle.megatron_accepts``, written from Megatron's rules
without the planner's code, and "most GPUs" by brute force over every way of taking GPUs
from the nodes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from elasticft.config import ConfigError, PlannerConfig
from elasticft.planner.layout import (
    BatchFacts,
    ModelFacts,
    NoLegalLayout,
    Policy,
    plan,
    plan_env,
    with_limits,
)
from elasticft.planner.megatron_args import (
    load_model_config,
    model_facts_from_argv,
    rewrite_megatron_args,
)
from launcher.cli import app
from tests.planner_oracle import brute_force, cases, megatron_accepts, small_clusters

REPO = Path(__file__).resolve().parents[1]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(c=cases(), nodes=small_clusters, preferred=st.none() | st.sampled_from([1, 2, 4, 8]))
def test_plan_is_legal_uses_most_gpus_and_keeps_previous_tp(c, nodes, preferred):
    model, batch, policy = c.inputs(preferred)
    best, legal = brute_force(nodes, c)
    if best == 0:
        with pytest.raises(NoLegalLayout, match=f"no legal layout for {sum(nodes)} GPU"):
            plan(model, batch, nodes, policy)
        return
    chosen = plan(model, batch, nodes, policy, with_layouts=True)
    assert chosen == plan(model, batch, nodes, policy, with_layouts=True)  # deterministic
    assert chosen.used == best
    assert {(lay.tp, lay.pp, lay.dp) for lay in chosen.layouts} == legal
    assert megatron_accepts(chosen.tp, chosen.pp, chosen.dp, chosen.used_per_node, c)
    if preferred in {tp for tp, _, _ in legal}:
        assert chosen.tp == preferred
    # Spare ranks: each node runs its first used_per_node[i] local ranks, ranks numbered
    # node by node; the rest are spare, and nodes running nothing are listed.
    start, spare = 0, []
    for size, count in zip(nodes, chosen.used_per_node):
        assert 0 <= count <= size
        spare += range(start + count, start + size)
        start += size
    assert chosen.spare == spare and len(spare) == sum(nodes) - chosen.used
    assert chosen.spare_nodes == [i for i, n in enumerate(chosen.used_per_node) if n == 0]
    # Whole nodes first: GPUs a TP group can use are cut from at most one node, and only
    # nodes no bigger than every kept node are dropped whole.
    usable = [size - size % chosen.tp for size in nodes]
    kept = [u for u, n in zip(usable, chosen.used_per_node) if n]
    assert sum(1 for u, n in zip(usable, chosen.used_per_node) if 0 < n < u) <= 1
    assert all(u <= min(kept) for u, n in zip(usable, chosen.used_per_node) if n == 0)


@settings(max_examples=100, deadline=None)
@given(c=cases(), nodes=small_clusters, hidden=st.sampled_from([64, 1024, 8192]),
       limit=st.sampled_from([0.5, 4.0, 40.0]))
def test_memory_limit_rejects_layouts_and_more_memory_never_uses_fewer_gpus(c, nodes, hidden,
                                                                             limit):
    model, batch, policy = c.inputs()
    model = ModelFacts(c.layers, c.heads, c.groups, hidden_size=hidden, seq_length=2048,
                       vocab_size=32000)

    def used(gb):
        try:
            chosen = plan(model, batch, nodes, replace(policy, memory_per_gpu_gb=gb),
                          with_layouts=True)
        except NoLegalLayout:
            return 0
        assert all(lay.memory_gb <= gb for lay in chosen.layouts)
        return chosen.used

    assert used(limit) <= used(limit * 4) <= used(1e9)


# Worked example (docs/planner.md): 32 heads, 24 layers, hidden 8192, sequence 2048,
# GBS 512, MBS 1, 8 GPUs per node, 80 GB per GPU. About 20B parameters need 18 bytes
# each, so TP·PP must be at least 8 to fit (TP=1, PP=8 holds 44 GB of state + 14 GB of
# activations).
EXAMPLE_MODEL = ModelFacts(num_layers=24, num_attention_heads=32, hidden_size=8192,
                           seq_length=2048, vocab_size=51200)
EXAMPLE_BATCH = BatchFacts(global_batch_size=512, micro_batch_size=1)


def test_worked_example_64_then_node_loss_then_broken_gpu():
    limits = Policy(memory_per_gpu_gb=80)
    # 64 GPUs: all used. Of the ten fitting layouts TP=2, PP=4, DP=8 is cheapest: TP=1
    # needs PP=8 (10% bubble), TP=4 and TP=8 pay more for TP all-reduces than PP=4's
    # 4.5% bubble costs.
    first = plan(EXAMPLE_MODEL, EXAMPLE_BATCH, [8] * 8, limits, with_layouts=True)
    assert (first.tp, first.pp, first.dp, first.used, first.spare) == (2, 4, 8, 64, [])
    assert len(first.layouts) == 10 and first.layouts[0].step_seconds < first.layouts[1].step_seconds
    # A node dies: 56 GPUs. 56 = 7·8 and neither 24 layers nor a power-of-two DP takes
    # the 7, so 48 GPUs is the most (PP=3 or a multiple of 3). TP=2 is kept; with it
    # PP=3, DP=8 (66 GB) is cheapest. The last node is spare as a whole.
    keep = Policy(memory_per_gpu_gb=80, preferred_tp=first.tp)
    second = plan(EXAMPLE_MODEL, EXAMPLE_BATCH, [8] * 7, keep)
    assert (second.tp, second.pp, second.dp, second.used) == (2, 3, 8, 48)
    assert second.spare == list(range(48, 56)) and second.spare_nodes == [6]
    assert "TP=2 kept" in second.reason and "48 of 56" in second.reason
    # Then one GPU of the last node breaks: 8·6 + 7 = 55 GPUs. Still 48 at most; the
    # broken node is the smallest, so it is the one left out, all 7 of its GPUs.
    third = plan(EXAMPLE_MODEL, EXAMPLE_BATCH, [8] * 6 + [7], keep)
    assert (third.tp, third.pp, third.dp, third.used) == (2, 3, 8, 48)
    assert third.spare == list(range(48, 55)) and third.spare_nodes == [6]
    assert plan_env(third) == {"EFT_TP": "2", "EFT_PP": "3", "EFT_DP": "8"}


def test_worked_example_without_memory_limit_uses_pure_data_parallelism():
    chosen = plan(EXAMPLE_MODEL, EXAMPLE_BATCH, [8] * 8)
    assert (chosen.tp, chosen.pp, chosen.dp) == (1, 1, 64)


def test_partial_node_keeps_tp_and_leaves_the_remainder_spare():
    # 8,8,8,7 with TP=4 preferred: 4 of the broken node's 7 GPUs still form a TP group,
    # 28 GPUs would need DP=7 (512 is a power of two), so 24 are used; the smallest
    # node (capacity 4) is dropped whole rather than cutting a full one.
    chosen = plan(ModelFacts(24, 32), EXAMPLE_BATCH, [8, 8, 8, 7], Policy(preferred_tp=4))
    assert (chosen.tp, chosen.used, chosen.spare_nodes) == (4, 24, [3])
    assert chosen.spare == [24, 25, 26, 27, 28, 29, 30]


def test_interleaved_pipeline_needs_pp_above_one_and_whole_microbatch_groups():
    model = ModelFacts(num_layers=24, num_attention_heads=32)
    chosen = plan(model, BatchFacts(16, 1), [8], Policy(layers_per_virtual_stage=2),
                  with_layouts=True)
    assert chosen.pp > 1 and chosen.used == 8
    for lay in chosen.layouts:
        assert lay.vp == 24 // lay.pp // 2 and lay.microbatches % lay.pp == 0


def test_uneven_first_and_last_stages():
    # 30 layers, 3 on the first and last stage: 24 middle layers over PP-2 stages.
    model = ModelFacts(num_layers=30, num_attention_heads=8)
    policy = Policy(decoder_first_pipeline_num_layers=3, decoder_last_pipeline_num_layers=3)
    chosen = plan(model, BatchFacts(8, 1), [6], policy, with_layouts=True)
    assert {lay.pp for lay in chosen.layouts} <= {3, 4, 5, 6}
    with pytest.raises(NoLegalLayout, match="PP=1 leaves 24 middle layers for 0 middle stages"):
        plan(model, BatchFacts(8, 1), [1], policy)


def test_no_legal_layout_names_each_failing_constraint_on_one_line():
    with pytest.raises(NoLegalLayout) as caught:
        plan(ModelFacts(num_layers=5, num_attention_heads=32), BatchFacts(7, 2), [3])
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("no legal layout for 3 GPUs (nodes 3) or any fewer")
    assert "TP=3 does not divide num_attention_heads 32" in message
    assert "PP=3 does not divide num_layers 5" in message
    assert "micro_batch_size 2 × DP not dividing global_batch_size 7" in message


def test_no_legal_layout_when_nothing_fits_in_memory():
    with pytest.raises(NoLegalLayout, match=r"TP=1,PP=1,DP=8 needs about \d+ GB per GPU, "
                                            r"over memory_per_gpu_gb 10"):
        plan(EXAMPLE_MODEL, EXAMPLE_BATCH, [8], Policy(memory_per_gpu_gb=10, max_tp_per_node=1))


def test_bad_input_is_a_value_error_naming_the_field():
    with pytest.raises(ValueError, match="num_layers: expected a positive integer"):
        ModelFacts(num_layers=0, num_attention_heads=8)
    with pytest.raises(ValueError, match="not a multiple of num_query_groups 3"):
        ModelFacts(num_layers=2, num_attention_heads=8, num_query_groups=3)
    with pytest.raises(ValueError, match="needs the model's hidden_size"):
        plan(ModelFacts(2, 8), BatchFacts(8, 1), [8], Policy(memory_per_gpu_gb=80))
    with pytest.raises(ValueError, match="GPUs per node"):
        plan(ModelFacts(2, 8), BatchFacts(8, 1), [8, -1])


def test_operator_limits_from_config_knobs():
    policy = with_limits(Policy(preferred_tp=8), PlannerConfig(max_tp_per_node=2, min_dp=4))
    chosen = plan(ModelFacts(24, 32), EXAMPLE_BATCH, [8, 8], policy)
    assert chosen.tp <= 2 and chosen.dp >= 4


def test_100000_gpus_plan_in_well_under_a_second():
    started = time.perf_counter()
    chosen = plan(EXAMPLE_MODEL, BatchFacts(4096, 1), [8] * 12500,
                  Policy(memory_per_gpu_gb=80, preferred_tp=2))
    assert time.perf_counter() - started < 1.0
    assert chosen.used + len(chosen.spare) == 100_000


# Megatron arguments

ARGV = ["pretrain_gpt.py", "--num-layers", "24", "--hidden-size=2048", "--num-attention-heads",
        "32", "--seq-length", "2048", "--global-batch-size=512", "--micro-batch-size", "1",
        "--tensor-model-parallel-size", "4", "--lr", "3e-4", "--pipeline-model-parallel-size=2",
        "--num-query-groups", "8", "--num-layers-per-virtual-pipeline-stage", "3", "--bf16"]


def test_facts_from_argv_read_both_spellings():
    model, batch, tp, pp, vp = model_facts_from_argv(ARGV)
    assert (model.num_layers, model.hidden_size, model.num_attention_heads) == (24, 2048, 32)
    assert model.num_query_groups == 32  # --num-query-groups counts only with GQA switched on
    assert (batch.global_batch_size, batch.micro_batch_size, tp, pp, vp) == (512, 1, 4, 2, 3)
    facts = model_facts_from_argv(ARGV + ["--group-query-attention", "--num-layers", "48"])
    assert facts.model.num_query_groups == 8 and facts.model.num_layers == 48  # last one wins
    assert facts.policy.preferred_tp == 4 and facts.policy.layers_per_virtual_stage == 3


def test_facts_from_argv_missing_or_bad_flag_is_named():
    without_gbs = [a for a in ARGV if not a.startswith("--global-batch-size")]
    with pytest.raises(ConfigError, match="--global-batch-size is required"):
        model_facts_from_argv(without_gbs)
    with pytest.raises(ConfigError, match="--num-layers expects a positive integer, got 'x'"):
        model_facts_from_argv(ARGV + ["--num-layers", "x"])
    with pytest.raises(ConfigError, match="--seq-length has no value"):
        model_facts_from_argv(ARGV + ["--seq-length"])


def test_rewrite_replaces_tp_and_pp_in_place_and_keeps_everything_else():
    chosen = plan(ModelFacts(24, 32), EXAMPLE_BATCH, [8] * 2, Policy(preferred_tp=8))
    out = rewrite_megatron_args(ARGV, chosen)
    expected = list(ARGV)
    expected[expected.index("--tensor-model-parallel-size") + 1] = str(chosen.tp)
    expected[expected.index("--pipeline-model-parallel-size=2")] = \
        f"--pipeline-model-parallel-size={chosen.pp}"
    assert out == expected and "--global-batch-size=512" in out
    bare = rewrite_megatron_args(["train.py", "--global-batch-size", "512"], chosen)
    assert bare == ["train.py", "--global-batch-size", "512", "--tensor-model-parallel-size",
                    str(chosen.tp), "--pipeline-model-parallel-size", str(chosen.pp)]


def test_load_model_config(tmp_path):
    good = tmp_path / "model.json"
    good.write_text(json.dumps({"num_layers": 24, "hidden_size": 2048, "num_attention_heads": 32,
                                "num_query_groups": 8, "seq_length": 2048, "params": 1_300_000_000,
                                "global_batch_size": 512, "micro_batch_size": 1}))
    model, batch, tp, pp, vp = load_model_config(good)
    assert (model.num_query_groups, model.params, batch.global_batch_size, tp, pp, vp) == \
        (8, 1_300_000_000, 512, 1, 1, None)
    for text, problem in [("{", "not valid JSON (Expecting property name"),
                          ("[1]", "expected a JSON object"),
                          ('{"num_layer": 2}', "unknown key 'num_layer'"),
                          ('{"num_layers": 2}', "hidden_size is required"),
                          ('{"num_layers": true}', "num_layers expects a positive integer")]:
        good.write_text(text)
        with pytest.raises(ConfigError) as caught:
            load_model_config(good)
        assert str(caught.value).startswith(f"{good}: ") and problem in str(caught.value)
        assert "\n" not in str(caught.value)
    with pytest.raises(ConfigError, match="cannot read model config"):
        load_model_config(tmp_path / "missing.json")


# `eft plan`

EXAMPLE_FLAGS = ["--num-layers", "24", "--num-attention-heads", "32", "--hidden-size", "8192",
                 "--seq-length", "2048", "--vocab-size", "51200", "--global-batch-size", "512",
                 "--micro-batch-size", "1", "--memory-per-gpu-gb", "80"]


def eft(*args, env=None):
    return CliRunner().invoke(app, ["plan", *args], env=env)


def test_cli_json_after_node_loss():
    result = eft("--nodes", "8,8,8,8,8,8,7", "--previous-tp", "2", "--json", *EXAMPLE_FLAGS)
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert {k: out[k] for k in ("tp", "pp", "dp", "used", "spare")} == \
        {"tp": 2, "pp": 3, "dp": 8, "used": 48, "spare": list(range(48, 55))}
    assert "TP=2 kept" in out["reason"] and "layouts" not in out


def test_cli_all_lists_every_legal_layout_in_text_and_json():
    text = eft("--world-size", "64", "--all", *EXAMPLE_FLAGS)
    assert text.exit_code == 0
    assert "layout  TP=2 PP=4 DP=8" in text.stdout and "spare   none" in text.stdout
    assert "legal layouts on 64 GPUs" in text.stdout and "58.1" in text.stdout  # TP=1 PP=8
    out = json.loads(eft("--world-size", "64", "--all", "--json", *EXAMPLE_FLAGS).stdout)
    assert len(out["layouts"]) == 10 and out["layouts"][0]["tp"] == 2
    assert all(lay["used"] == 64 and lay["step_seconds"] > 0 for lay in out["layouts"])


def test_cli_world_size_makes_a_partial_last_node():
    result = eft("--world-size", "20", "--gpus-per-node", "8", "--json", "--num-layers", "5",
                 "--num-attention-heads", "8", "--global-batch-size", "16",
                 "--micro-batch-size", "1", "--previous-tp", "4")
    out = json.loads(result.stdout)
    assert out["used_per_node"] == [8, 8, 4] and out["tp"] == 4


def test_cli_knob_from_environment():
    result = eft("--world-size", "16", "--json", *EXAMPLE_FLAGS[:4], *EXAMPLE_FLAGS[10:12],
                 "--micro-batch-size", "1", env={"EFT_MAX_TP_PER_NODE": "1"})
    assert json.loads(result.stdout)["tp"] == 1


def test_cli_model_config_file_and_flag_override(tmp_path):
    config = tmp_path / "model.json"
    config.write_text(json.dumps({"num_layers": 24, "hidden_size": 8192, "num_attention_heads": 32,
                                  "seq_length": 2048, "vocab_size": 51200,
                                  "global_batch_size": 512, "micro_batch_size": 1}))
    args = ["--world-size", "64", "--model-config", str(config), "--memory-per-gpu-gb", "80",
            "--json"]
    assert json.loads(eft(*args).stdout)["tp"] == 2  # the worked example again
    # 25 layers: PP must be 1, 5 or 25 and divide 64, so PP=1 and TP=8 to fit 80 GB
    out = json.loads(eft(*args, "--num-layers", "25").stdout)
    assert (out["tp"], out["pp"], out["dp"]) == (8, 1, 8)
    config.write_text('{"num_layers": 24,}')
    result = eft(*args)
    assert result.exit_code == 2 and result.stderr.startswith(f"eft plan: {config}: not valid JSON")


@pytest.mark.parametrize("args, message", [
    (["--world-size", "3", "--num-layers", "5", "--num-attention-heads", "32",
      "--global-batch-size", "7", "--micro-batch-size", "2"], "no legal layout for 3 GPUs"),
    (["--world-size", "8", "--nodes", "8"], "give either --world-size or --nodes"),
    (["--nodes", "8,x", "--num-layers", "2"], "--nodes expects GPU counts"),
    (["--world-size", "8", "--num-layers", "two"], "Invalid value for '--num-layers'"),
    (["--world-size", "8", "--num-layers", "2"], "--num-attention-heads is required"),
])
def test_cli_bad_input_exits_2_with_one_line(args, message):
    result = eft(*args)
    assert result.exit_code == 2
    assert result.stderr.startswith("eft plan: ") and message in result.stderr
    assert result.stderr.count("\n") == 1 and result.stdout == ""


def test_cli_process_exit_status_and_stderr():
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-m", "launcher.cli", "plan", "--nodes", "8,8", "--num-layers", "7",
         "--num-attention-heads", "5", "--global-batch-size", "3", "--micro-batch-size", "2"],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("eft plan: no legal layout for 16 GPUs (nodes 8,8)")
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


GPT_ARGV = ["--num-layers", "8", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "128",
            "--global-batch-size", "24", "--micro-batch-size", "1", "--tensor-model-parallel-size", "2",
            "--pipeline-model-parallel-size", "2"]


@pytest.mark.parametrize("extra, dp_only", [
    ([], False),
    (["--use-distributed-optimizer"], True),  # Megatron's default dp_reshardable optimizer state
    (["--use-distributed-optimizer", "--dist-ckpt-optim-fully-reshardable"], False),
    (["--use-distributed-optimizer", "--no-load-optim"], False),
    (["--ckpt-format", "torch"], True),
    (["--ckpt-format=torch_dist"], False),
])
def test_a_replan_changes_tp_or_pp_only_where_the_checkpoint_format_reshards_them(extra, dp_only):
    """8 GPUs at TP2xPP2 lose 2: a format that reshards DP only keeps TP2xPP2 on 4 of the 6
    (Megatron would refuse to load any other); one that reshards everything uses all 6."""
    from elasticft.planner.megatron_args import model_facts_from_argv, reshard_rule

    facts = model_facts_from_argv(GPT_ARGV + extra)
    chosen = plan(facts.model, facts.batch, [4, 2], facts.policy)
    assert reshard_rule(GPT_ARGV + extra)[0] is dp_only
    if dp_only:
        assert (chosen.tp, chosen.pp, chosen.used) == (2, 2, 4)
        assert "change DP only" in reshard_rule(GPT_ARGV + extra)[1]
    else:
        assert chosen.used == 6 and (chosen.tp, chosen.pp) != (2, 2)


def test_a_dp_only_format_with_no_layout_left_says_why():
    from elasticft.planner.megatron_args import model_facts_from_argv

    facts = model_facts_from_argv(GPT_ARGV + ["--use-distributed-optimizer"])
    with pytest.raises(NoLegalLayout, match=r"TP=1.*is not the checkpoint's TP 2 \(its format reshards DP only\)"):
        plan(facts.model, facts.batch, [3], facts.policy)
