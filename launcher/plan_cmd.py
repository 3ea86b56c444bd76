"""``eft plan``: show the TP×PP×DP layout eft-run would choose for a set of GPUs.

Bad input and "no legal layout" exit with status 2 and one line on stderr.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, NoReturn, Optional

import typer
from rich.console import Console
from rich.table import Table

from elasticft import bridge_seam
from elasticft.config import PlannerConfig, env_name
from elasticft.planner.layout import (
    BatchFacts,
    ModelFacts,
    Plan,
    Policy,
    plan,
    with_limits,
)
from elasticft.planner.megatron_args import load_model_config
from launcher.one_line import OneLineErrors, fail

_KNOBS = {f.name: f for f in dataclasses.fields(PlannerConfig)}


def _knob_option(name: str) -> Any:
    """A typer option for a PlannerConfig knob: same default, help and EFT_* variable."""
    knob = _KNOBS[name]
    return typer.Option(knob.default, "--" + name.replace("_", "-"), envvar=env_name(name),
                        help=knob.metadata["help"])


def _fail(message: str) -> NoReturn:
    fail("plan", message)


def cluster_nodes(world_size: int | None, nodes: str | None, gpus_per_node: int) -> list[int]:
    """GPUs per node from --nodes, or --world-size N as ceil(N/G) nodes of G, the last partial."""
    if (world_size is None) == (nodes is None):
        raise ValueError("give either --world-size or --nodes")
    if nodes is not None:
        try:
            counts = [int(part) for part in nodes.split(",")]
        except ValueError:
            raise ValueError(f"--nodes expects GPU counts like 8,8,8,7, got {nodes!r}") from None
        if any(count < 0 for count in counts):
            raise ValueError(f"--nodes expects GPU counts >= 0, got {nodes!r}")
        return counts
    if world_size < 1 or gpus_per_node < 1:
        raise ValueError("--world-size and --gpus-per-node must be at least 1")
    full, partial = divmod(world_size, gpus_per_node)
    return [gpus_per_node] * full + ([partial] if partial else [])


def _ranges(ranks: list[int]) -> str:
    """48,49,50,60 -> '48-50, 60'."""
    spans: list[list[int]] = []
    for rank in ranks:
        if spans and rank == spans[-1][1] + 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def recipe_fields(chosen: Plan) -> dict[str, int]:
    """What eft-run sets in a Megatron-Bridge recipe's ConfigContainer for this plan
    (megatron_bridge/recipe.py, at ``pretrain``)."""
    return {bridge_seam.TP: chosen.tp, bridge_seam.PP: chosen.pp}


def print_plan(chosen: Plan, bridge: bool = False) -> None:
    console = Console(highlight=False, soft_wrap=True)
    vp = f" VP={chosen.vp}" if chosen.vp else ""
    console.print(f"layout  TP={chosen.tp} PP={chosen.pp} DP={chosen.dp}{vp}")
    if bridge:
        fields = ", ".join(f"{name}={value}" for name, value in recipe_fields(chosen).items())
        console.print(f"recipe  {fields} (eft-run sets them in the recipe's ConfigContainer at pretrain, "
                      "from EFT_TP and EFT_PP; DP follows from the world size; the command line is left as it is)")
    console.print(f"used    {chosen.used} of {chosen.world} GPUs")
    if chosen.spare:
        idle = chosen.spare_nodes
        nodes = f" (node{'s' if len(idle) > 1 else ''} {_ranges(idle)} run{'' if len(idle) > 1 else 's'} " \
            "nothing)" if idle else ""
        console.print(f"spare   {len(chosen.spare)} ranks: {_ranges(chosen.spare)}{nodes}")
    else:
        console.print("spare   none")
    console.print(f"reason  {chosen.reason}")
    if chosen.layouts is None:
        return
    table = Table(title=f"legal layouts on {chosen.used} GPUs, best first")
    for column in ("TP", "PP", "DP", "VP", "microbatches", "bubble", "est. step s", "GB/GPU"):
        table.add_column(column, justify="right")
    for lay in chosen.layouts:
        memory = "?" if lay.memory_gb is None else f"{lay.memory_gb:.1f}"
        table.add_row(str(lay.tp), str(lay.pp), str(lay.dp), str(lay.vp or "-"),
                      str(lay.microbatches), f"{lay.bubble:.1%}", f"{lay.step_seconds:.3f}",
                      memory)
    console.print(table)


def plan_command(
    world_size: Optional[int] = typer.Option(
        None, "--world-size", help="total GPUs, taken as ceil(N/G) nodes of --gpus-per-node G "
        "with the last node partial"),
    nodes: Optional[str] = typer.Option(
        None, "--nodes", help="GPUs of every live node in rank order, e.g. 8,8,8,7"),
    gpus_per_node: int = typer.Option(8, "--gpus-per-node", envvar=env_name("gpus_per_node"),
                                      help="GPUs per node for --world-size"),
    model_config: Optional[Path] = typer.Option(
        None, "--model-config", help="JSON model facts keyed by Megatron flag names, e.g. "
        '{"num_layers": 24, ...}; the flags below override it'),
    num_layers: Optional[int] = typer.Option(None, "--num-layers"),
    num_attention_heads: Optional[int] = typer.Option(None, "--num-attention-heads"),
    num_query_groups: Optional[int] = typer.Option(
        None, "--num-query-groups", help="KV groups (default: one per head)"),
    hidden_size: Optional[int] = typer.Option(
        None, "--hidden-size", help="for the cost model; needed with --memory-per-gpu-gb"),
    seq_length: Optional[int] = typer.Option(
        None, "--seq-length", help="for the cost model; needed with --memory-per-gpu-gb"),
    vocab_size: Optional[int] = typer.Option(None, "--vocab-size", help="for the cost model"),
    params: Optional[int] = typer.Option(
        None, "--params", help="exact parameter count (default: estimated from the sizes)"),
    global_batch_size: Optional[int] = typer.Option(None, "--global-batch-size"),
    micro_batch_size: Optional[int] = typer.Option(None, "--micro-batch-size"),
    previous_tp: Optional[int] = typer.Option(
        None, "--previous-tp", help="TP of the running layout; kept when legal (no TP reshard)"),
    layers_per_virtual_stage: Optional[int] = typer.Option(
        None, "--num-layers-per-virtual-pipeline-stage"),
    virtual_stages_per_rank: Optional[int] = typer.Option(
        None, "--num-virtual-stages-per-pipeline-rank"),
    first_stage_layers: Optional[int] = typer.Option(None, "--decoder-first-pipeline-num-layers"),
    last_stage_layers: Optional[int] = typer.Option(None, "--decoder-last-pipeline-num-layers"),
    max_tp_per_node: int = _knob_option("max_tp_per_node"),
    memory_per_gpu_gb: float = _knob_option("memory_per_gpu_gb"),
    min_dp: int = _knob_option("min_dp"),
    as_json: bool = typer.Option(False, "--json", help="print the plan as JSON"),
    show_all: bool = typer.Option(False, "--all", help="also list every legal layout"),
    megatron_bridge: bool = typer.Option(
        False, "--megatron-bridge", help="a Megatron-Bridge recipe's job: also say what eft-run sets in its "
        "ConfigContainer"),
) -> None:
    """Show the TP×PP×DP layout eft-run would choose, and the spare ranks."""
    try:
        cluster = cluster_nodes(world_size, nodes, gpus_per_node)
        model: dict[str, Any] = {}
        batch: dict[str, Any] = {}
        policy = Policy()
        if model_config is not None:
            facts = load_model_config(model_config)
            model, batch = dataclasses.asdict(facts.model), dataclasses.asdict(facts.batch)
            if model["num_query_groups"] == model["num_attention_heads"]:
                del model["num_query_groups"]  # the default: follow a --num-attention-heads override
            policy = dataclasses.replace(facts.policy, preferred_tp=None)
        given = dict(num_layers=num_layers, num_attention_heads=num_attention_heads,
                     num_query_groups=num_query_groups, hidden_size=hidden_size,
                     seq_length=seq_length, vocab_size=vocab_size, params=params)
        model.update({key: value for key, value in given.items() if value is not None})
        given = dict(global_batch_size=global_batch_size, micro_batch_size=micro_batch_size)
        batch.update({key: value for key, value in given.items() if value is not None})
        for key in ("num_layers", "num_attention_heads", "global_batch_size", "micro_batch_size"):
            if key not in model and key not in batch:
                raise ValueError(f"--{key.replace('_', '-')} is required (or --model-config)")
        given = dict(preferred_tp=previous_tp, layers_per_virtual_stage=layers_per_virtual_stage,
                     virtual_stages_per_rank=virtual_stages_per_rank,
                     decoder_first_pipeline_num_layers=first_stage_layers,
                     decoder_last_pipeline_num_layers=last_stage_layers)
        policy = dataclasses.replace(
            policy, **{key: value for key, value in given.items() if value is not None})
        limits = PlannerConfig(max_tp_per_node, memory_per_gpu_gb, min_dp)
        chosen = plan(ModelFacts(**model), BatchFacts(**batch), cluster,
                      with_limits(policy, limits), with_layouts=show_all)
    except ValueError as err:  # NoLegalLayout and ConfigError are ValueErrors
        _fail(str(err))
    if as_json:
        out = chosen.to_dict()
        if "layouts" in out:
            out["layouts"] = [dict(lay, used=lay["tp"] * lay["pp"] * lay["dp"])
                              for lay in out["layouts"]]
        if megatron_bridge:
            out["recipe"] = recipe_fields(chosen)
        typer.echo(json.dumps(out))
    else:
        print_plan(chosen, megatron_bridge)


def register(app: typer.Typer) -> None:
    app.command("plan", cls=OneLineErrors)(plan_command)
