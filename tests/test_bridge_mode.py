"""Which jobs eft enters Megatron-Bridge's loop for (elasticft/megatron_bridge/mode.py), what a
re-plan and eft's fault tolerance change in a recipe's ConfigContainer (recipe.py), and the
planner leaving a Bridge job's command line alone. No Bridge needed: these run in every lane
(the Bridge lane, tests/megatron_bridge, runs the loop itself)."""

import json
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench.launch import eft_run
from elasticft import bridge_seam
from elasticft.agent.replan import RoundPlanner
from elasticft.config import ConfigError, PlannerConfig
from elasticft.contract.run_dir import TrainingLoop, WorkerEnv
from elasticft.megatron_bridge import recipe
from elasticft.megatron_bridge.mode import worker_environment
from elasticft.megatron_lm.mode import BOOT_DIR

RECIPE = ("from megatron.bridge.training.pretrain import pretrain\n"
          "from megatron.bridge.training.gpt_step import forward_step\n\n"
          "if __name__ == '__main__':\n    pretrain(config(), forward_step)\n")
MEGATRON_LM = "from megatron.training import pretrain\n"


@pytest.fixture
def in_range(monkeypatch):
    monkeypatch.setattr(bridge_seam, "installed_version", lambda: "0.6.2")


def script(tmp_path: Path, text: str, name: str = "train.py") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_auto_enters_bridges_loop_for_a_recipe_script_and_its_modules(tmp_path, in_range, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/site/own")
    env = worker_environment("auto", script(tmp_path, RECIPE))
    assert env["PYTHONPATH"].split(":") == [str(BOOT_DIR), "/site/own"]
    assert env[WorkerEnv.TRAINING_LOOP] == TrainingLoop.MEGATRON_BRIDGE
    script(tmp_path, "from megatron.bridge.training.config import ConfigContainer\n", name="my_recipes.py")
    assert worker_environment("auto", script(tmp_path, "import my_recipes\n", name="run.py"))


def test_a_megatron_lm_script_or_off_gets_no_bridge_mode_and_on_without_bridge_is_one_line(tmp_path, in_range):
    assert worker_environment("auto", script(tmp_path, MEGATRON_LM)) == {}
    assert worker_environment("off", script(tmp_path, RECIPE)) == {}
    with pytest.raises(ConfigError, match=r"^--eft-megatron-bridge on: \S+ does not import megatron.bridge.training"):
        worker_environment("on", script(tmp_path, MEGATRON_LM))


def test_a_bridge_older_than_the_tested_range_is_refused_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(bridge_seam, "installed_version", lambda: "0.4.1")
    with pytest.raises(ConfigError, match=r"^--eft-megatron-bridge: megatron-bridge 0.4.1 is not supported"):
        worker_environment("auto", script(tmp_path, RECIPE))


def test_a_bad_mode_value_is_one_line_naming_the_flag(tmp_path):
    done = subprocess.run([*eft_run(), "--standalone", "--eft-megatron-bridge", "maybe", script(tmp_path, RECIPE)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "--eft-megatron-bridge: expected auto, on or off, got 'maybe'" in done.stderr
    assert "Traceback" not in done.stderr


def config(tp=2, pp=1, ft=None, distributed_optimizer=False, fully_reshardable=False):
    """The parts of a ConfigContainer recipe.apply touches."""
    return SimpleNamespace(model=SimpleNamespace(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp),
                           ft=ft, optimizer=SimpleNamespace(use_distributed_optimizer=distributed_optimizer),
                           checkpoint=SimpleNamespace(dist_ckpt_optim_fully_reshardable=fully_reshardable))


def test_the_plans_tp_and_pp_go_into_the_recipe_and_nvrxs_rank_monitor_is_turned_off(monkeypatch, capsys):
    monkeypatch.setenv("EFT_TP", "1")
    monkeypatch.setenv("EFT_PP", "1")
    monkeypatch.setenv("RANK", "0")
    container = config(tp=2, ft=SimpleNamespace(enable_ft_package=True))
    changes = recipe.apply(container)
    assert (container.model.tensor_model_parallel_size, container.model.pipeline_model_parallel_size) == (1, 1)
    assert container.ft.enable_ft_package is False
    assert changes == ["model.tensor_model_parallel_size 2 -> 1 (eft's plan)",
                       "ft.enable_ft_package off: eft times Bridge's sections in place of NVRx's rank monitor"]
    assert capsys.readouterr().out.count("eft: the recipe's ConfigContainer:") == 1


def test_nvrxs_in_process_restart_is_turned_off_in_one_line(monkeypatch, capsys):
    """A recipe with NVRx's in-process restart on would run _pretrain again inside the worker on
    destroyed groups while eft's hook holds them: eft turns it off and says so, once."""
    monkeypatch.delenv("EFT_TP", raising=False)
    monkeypatch.delenv("EFT_PP", raising=False)
    monkeypatch.setenv("RANK", "0")
    container = config()
    container.inprocess_restart = SimpleNamespace(enabled=True, max_iterations=5)
    changes = recipe.apply(container)
    assert container.inprocess_restart.enabled is False
    assert changes == ["inprocess_restart off: eft restarts the workers itself (NVRx's in-process restart would run "
                       "the training again in this process on groups eft's hook holds)"]
    assert capsys.readouterr().out.count("inprocess_restart off") == 1
    container.inprocess_restart = None  # Bridge's default: nothing to say
    assert recipe.apply(container) == []


def test_a_new_tp_with_a_dp_reshardable_optimizer_says_which_field_lets_the_checkpoint_load(monkeypatch):
    monkeypatch.setenv("EFT_TP", "1")
    monkeypatch.setenv("EFT_PP", "1")
    changes = recipe.apply(config(tp=2, distributed_optimizer=True))
    assert changes[-1].endswith("(set checkpoint.dist_ckpt_optim_fully_reshardable=true in the recipe)")
    assert len(recipe.apply(config(tp=2, distributed_optimizer=True, fully_reshardable=True))) == 1
    assert recipe.apply(config(tp=1, distributed_optimizer=True)) == []  # the same layout: nothing to say


def test_without_a_plan_the_recipe_is_left_as_it_is(monkeypatch, capsys):
    monkeypatch.delenv("EFT_TP", raising=False)
    monkeypatch.delenv("EFT_PP", raising=False)
    container = config(tp=4, pp=2, ft=SimpleNamespace(enable_ft_package=False))
    assert recipe.apply(container) == [] and capsys.readouterr().out == ""
    assert (container.model.tensor_model_parallel_size, container.model.pipeline_model_parallel_size) == (4, 2)


def test_a_bridge_job_is_planned_from_its_model_config_and_its_command_line_is_left_alone(tmp_path):
    model = tmp_path / "model.json"
    model.write_text(json.dumps({"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32,
                                 "global_batch_size": 8, "micro_batch_size": 1, "tensor_model_parallel_size": 2}))
    argv = ("recipe.py", "checkpoint.save=/ckpt", "train.train_iters=100")
    assert RoundPlanner.for_worker(argv, PlannerConfig(), bridge=True) is None  # nothing to plan from
    planner = RoundPlanner.for_worker(argv, PlannerConfig(model_config=str(model)), bridge=True)

    class Store(dict):
        def set(self, key, value):
            self[key] = value

        def multi_get(self, keys):
            return [self[k] for k in keys]

    assignment = planner.assign(Store(), group_rank=0, group_world_size=1, local_world_size=4)
    assert planner.worker_args() == argv
    assert planner.worker_env()["EFT_TP"] == str(assignment.plan.tp)
    megatron_lm = RoundPlanner.for_worker(argv, PlannerConfig(model_config=str(model)))
    megatron_lm.assign(Store(), group_rank=0, group_world_size=1, local_world_size=4)
    assert "--tensor-model-parallel-size" in megatron_lm.worker_args()  # what a Bridge job must not get


def test_the_bridge_seam_names_only_what_it_checks():
    """Every ConfigContainer field recipe.py and loop.py read is one bridge_seam.problems() checks."""
    assert set(recipe.LAYOUT_ENV) <= set(bridge_seam.CONFIG_FIELDS)
    assert {bridge_seam.SAVE_DIR, bridge_seam.LOAD_DIR, bridge_seam.SAVE_INTERVAL,
            bridge_seam.ASYNC_SAVE} <= set(bridge_seam.CONFIG_FIELDS)


def test_eft_plan_says_which_recipe_fields_eft_run_sets_for_a_bridge_job():
    from typer.testing import CliRunner

    from launcher.cli import app

    args = ["plan", "--nodes", "8,8", "--num-layers", "32", "--num-attention-heads", "32", "--hidden-size", "4096",
            "--seq-length", "4096", "--global-batch-size", "64", "--micro-batch-size", "1",
            "--memory-per-gpu-gb", "40", "--json"]
    plain = json.loads(CliRunner().invoke(app, args).stdout)
    bridge = json.loads(CliRunner().invoke(app, [*args, "--megatron-bridge"]).stdout)
    assert "recipe" not in plain and plain["tp"] > 1
    assert bridge["recipe"] == {"model.tensor_model_parallel_size": plain["tp"],
                                "model.pipeline_model_parallel_size": plain["pp"]}
    text = CliRunner().invoke(app, [*args[:-1], "--megatron-bridge"]).stdout
    assert f"recipe  model.tensor_model_parallel_size={plain['tp']}, model.pipeline_model_parallel_size=" in text
