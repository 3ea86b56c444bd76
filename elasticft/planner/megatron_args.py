"""Megatron-LM's command line and eft's model file, read into the planner's facts, and
the rewrite of the command line that applies a plan.

Everything here is pure except ``load_model_config``, which reads the one file it is
given. Flag names are Megatron-LM's; both ``--flag value`` and ``--flag=value`` are
read, and a repeated flag counts by its last value, as argparse does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from elasticft.config import ConfigError
from elasticft.contract.argv import flag_value
from elasticft.planner.layout import BatchFacts, ModelFacts, Policy

TP_FLAG = "--tensor-model-parallel-size"
PP_FLAG = "--pipeline-model-parallel-size"

# Without these the planner cannot check legality or rank layouts. Megatron itself
# needs all of them except --global-batch-size, which it would set to micro batch × DP:
# the global batch would then change with every re-plan, so eft insists on it.
REQUIRED_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                 "global_batch_size", "micro_batch_size")
OPTIONAL_KEYS = ("num_query_groups", "vocab_size", "padded_vocab_size",
                 "tensor_model_parallel_size", "pipeline_model_parallel_size",
                 "num_layers_per_virtual_pipeline_stage", "num_virtual_stages_per_pipeline_rank",
                 "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers")
# Megatron-LM reads --num-query-groups only when --group-query-attention is given.
SWITCH_KEYS = ("group_query_attention",)
# What decides whether a checkpoint loads at another TP or PP (reshard_rule).
RESHARD_SWITCHES = ("use_distributed_optimizer", "dist_ckpt_optim_fully_reshardable", "no_load_optim")
# Not a Megatron flag: a model file may state the exact parameter count.
FILE_ONLY_KEYS = ("params",)


def flag(key: str) -> str:
    return "--" + key.replace("_", "-")


@dataclass(frozen=True)
class MegatronFacts:
    """What a Megatron command line (or model file) tells the planner.

    Unpacks as ``model, batch, tp, pp, vp``; ``vp`` is the value of
    --num-layers-per-virtual-pipeline-stage (None when absent). ``policy`` carries the
    running TP as the preferred one and the pipeline split; operator limits are unset.
    """

    model: ModelFacts
    batch: BatchFacts
    tp: int
    pp: int
    vp: int | None
    policy: Policy

    def __iter__(self) -> Iterator[Any]:
        return iter((self.model, self.batch, self.tp, self.pp, self.vp))


def _positive_int(raw: Any, name: str, source: str) -> int:
    if isinstance(raw, str):
        try:
            raw = int(raw.strip())
        except ValueError:
            raise ConfigError(f"{source}: {name} expects a positive integer, got {raw!r}") from None
    if isinstance(raw, bool) or not isinstance(raw, int) or raw < 1:
        raise ConfigError(f"{source}: {name} expects a positive integer, got {raw!r}")
    return raw


def _facts(values: dict[str, Any], name_of: Callable[[str], str], source: str) -> MegatronFacts:
    ints = {key: _positive_int(values[key], name_of(key), source)
            for key in REQUIRED_KEYS + OPTIONAL_KEYS + FILE_ONLY_KEYS
            if values.get(key) is not None}
    for key in REQUIRED_KEYS:
        if key not in ints:
            why = " (without it Megatron derives the global batch from DP, which " \
                  "changes with every re-plan)" if key == "global_batch_size" else ""
            raise ConfigError(f"{source}: {name_of(key)} is required{why}")
    groups = ints.get("num_query_groups")
    if values.get("group_query_attention") is False:
        groups = None
    try:
        model = ModelFacts(
            num_layers=ints["num_layers"],
            num_attention_heads=ints["num_attention_heads"],
            num_query_groups=groups,
            hidden_size=ints["hidden_size"],
            seq_length=ints["seq_length"],
            vocab_size=ints.get("padded_vocab_size") or ints.get("vocab_size"),
            params=ints.get("params"),
        )
        batch = BatchFacts(ints["global_batch_size"], ints["micro_batch_size"])
        tp = ints.get("tensor_model_parallel_size", 1)
        policy = Policy(
            preferred_tp=tp,
            layers_per_virtual_stage=ints.get("num_layers_per_virtual_pipeline_stage"),
            virtual_stages_per_rank=ints.get("num_virtual_stages_per_pipeline_rank"),
            decoder_first_pipeline_num_layers=ints.get("decoder_first_pipeline_num_layers"),
            decoder_last_pipeline_num_layers=ints.get("decoder_last_pipeline_num_layers"),
        )
    except ValueError as err:
        raise ConfigError(f"{source}: {err}") from None
    return MegatronFacts(model, batch, tp, ints.get("pipeline_model_parallel_size", 1),
                         ints.get("num_layers_per_virtual_pipeline_stage"), policy)


def scan_argv(argv: Sequence[str]) -> dict[str, Any]:
    """The values of the flags the planner reads; other arguments are skipped."""
    value_flags = {flag(key): key for key in REQUIRED_KEYS + OPTIONAL_KEYS}
    switch_flags = {flag(key): key for key in SWITCH_KEYS}
    values: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        name, eq, inline = argv[i].partition("=")
        if name in value_flags:
            if eq:
                values[value_flags[name]] = inline
            elif i + 1 < len(argv):
                values[value_flags[name]] = argv[i + 1]
                i += 1
            else:
                raise ConfigError(f"megatron arguments: {name} has no value")
        elif name in switch_flags and not eq:
            values[switch_flags[name]] = True
        i += 1
    if not values.get("group_query_attention"):
        values["group_query_attention"] = False
    return values


def model_facts_from_argv(argv: Sequence[str]) -> MegatronFacts:
    """Read Megatron-LM arguments; a missing required fact raises ConfigError naming the flag.
    A checkpoint format that reshards DP only fixes the policy's TP and PP (``reshard_rule``)."""
    facts = _facts(scan_argv(argv), flag, "megatron arguments")
    if reshard_rule(argv)[0]:
        policy = replace(facts.policy, fixed_tp=facts.tp, fixed_pp=facts.pp)
        facts = replace(facts, policy=policy)
    return facts


def reshard_rule(argv: Sequence[str]) -> tuple[bool, str]:
    """(whether re-plans must keep TP and PP, why), from what Megatron-LM will save and load.

    Megatron loads a checkpoint at another TP or PP only if its format can reshard it:
    the legacy ``--ckpt-format torch`` cannot, and with ``--use-distributed-optimizer`` a
    torch_dist checkpoint holds the optimizer ``dp_reshardable`` unless
    ``--dist-ckpt-optim-fully-reshardable`` is given (Megatron refuses a TP or PP change
    then; a DP change loads). ``--no-load-optim`` loads only the model, which reshards.
    """
    switches = {key for key in RESHARD_SWITCHES if flag(key) in argv}
    ckpt_format = flag_value(argv, "--ckpt-format") or "torch_dist"
    if "no_load_optim" in switches:
        return False, "the optimizer is not loaded (--no-load-optim): TP and PP may change at a re-plan"
    if ckpt_format == "torch":
        return True, "--ckpt-format torch does not reshard: re-plans keep TP and PP and change DP only"
    if "use_distributed_optimizer" in switches and "dist_ckpt_optim_fully_reshardable" not in switches:
        return True, ("the distributed optimizer's state is saved dp_reshardable: re-plans keep TP and PP and "
                      "change DP only (add --dist-ckpt-optim-fully-reshardable to let them change TP and PP)")
    return False, f"--ckpt-format {ckpt_format} reshards: TP and PP may change at a re-plan"



def load_model_config(path: str | Path) -> MegatronFacts:
    """Read a JSON object keyed by Megatron flag names without dashes, e.g.
    {"num_layers": 24, "hidden_size": 2048, ...}; "params" may give the exact
    parameter count. Bad input raises a one-line ConfigError naming the file."""
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{source}: cannot read model config ({getattr(err, 'strerror', None) or err})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError(f"{source}: not valid JSON ({err.msg} at line {err.lineno} "
                          f"column {err.colno})") from None
    if not isinstance(data, dict):
        raise ConfigError(f'{source}: expected a JSON object such as {{"num_layers": 24, ...}}')
    known = REQUIRED_KEYS + OPTIONAL_KEYS + SWITCH_KEYS + FILE_ONLY_KEYS
    values: dict[str, Any] = {}
    for key, value in data.items():
        normal = str(key).lstrip("-").replace("-", "_")
        if normal not in known:
            raise ConfigError(f"{source}: unknown key {key!r}; known keys: {', '.join(known)}")
        if normal in SWITCH_KEYS and not isinstance(value, bool):
            raise ConfigError(f"{source}: {key} expects true or false, got {value!r}")
        values[normal] = value
    return _facts(values, lambda key: key, source)


def rewrite_megatron_args(argv: Sequence[str], chosen: Any) -> list[str]:
    """``argv`` with ``chosen``'s TP and PP: values replaced in place, keeping each
    occurrence's spelling (``--x v`` or ``--x=v``), or appended when absent. Every other
    argument, --global-batch-size included, is kept as it was."""
    wanted = {TP_FLAG: str(chosen.tp), PP_FLAG: str(chosen.pp)}
    out: list[str] = []
    seen = set()
    i = 0
    while i < len(argv):
        name, eq, _ = argv[i].partition("=")
        if name in wanted:
            seen.add(name)
            if eq:
                out.append(f"{name}={wanted[name]}")
            elif i + 1 < len(argv):
                out += [name, wanted[name]]
                i += 1
            else:
                raise ConfigError(f"megatron arguments: {name} has no value")
        else:
            out.append(argv[i])
        i += 1
    for name, value in wanted.items():
        if name not in seen:
            out += [name, value]
    return out
