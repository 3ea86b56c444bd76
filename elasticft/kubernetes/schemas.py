"""The manifests checked against released schemas, the way the API server's strict field
validation would check them, without a cluster.

Two sources: the CustomResourceDefinitions as released (JobSet, prometheus-operator's
PodMonitor; vendored in ``schemas/``, README there) and Kubernetes' own kinds through the JSON
schemas the PyPI package kubernetes-validate bundles. A JobSet's replicated jobs are checked
twice: by JobSet's CRD (whose copy of the Job schema is the Kubernetes JobSet was built on) and
each template as a ``batch/v1`` Job of ``KUBERNETES_VERSION``.

Strict: a field the schema does not name is a problem, as ``kubectl apply`` (strict field
validation) and ``kubeconform -strict`` report it; a misspelt field is otherwise dropped
silently by the API server, and a misspelt ``podFailurePolicy`` key is a job that never stops.
"""

from __future__ import annotations

import functools
import re
from importlib import resources
from typing import Any, Iterable, Iterator

from elasticft.kubernetes.extra import MissingExtra, require

# Kubernetes' schemas for the core kinds: JobSet v0.12.0 is built on Kubernetes 1.36's API
# (its go.mod: k8s.io/api v0.36.0), the newest it knows the fields of.
KUBERNETES_VERSION = "1.36"
JOBSET_VERSION = "v0.12.0"
PROMETHEUS_OPERATOR_VERSION = "v0.93.0"
# (API group, kind) -> the vendored CRD file
CRD_FILES = {
    ("jobset.x-k8s.io", "JobSet"): f"jobset-{JOBSET_VERSION}.crd.yaml",
    ("monitoring.coreos.com", "PodMonitor"): f"podmonitor-{PROMETHEUS_OPERATOR_VERSION}.crd.yaml",
}
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
DNS_SUBDOMAIN_MAX = 253


def versions() -> str:
    """What the manifests are checked against, for the summary line."""
    return f"Kubernetes {KUBERNETES_VERSION}, JobSet {JOBSET_VERSION}, prometheus-operator {PROMETHEUS_OPERATOR_VERSION}"


def validate(objects: Iterable[Any]) -> list[str]:
    """One line per problem, ``<kind>/<name>: <path>: <message>``; empty when all are valid.

    Raises MissingExtra (one line: how to install it) without kubernetes-validate."""
    problems: list[str] = []
    for position, obj in enumerate(objects):
        if not isinstance(obj, dict) or not isinstance(obj.get("kind"), str) or not isinstance(
                obj.get("apiVersion"), str):
            problems.append(f"document {position + 1}: not a Kubernetes object (no apiVersion and kind)")
            continue
        problems += [f"{_label(obj)}: {path or '(top)'}: {message}" for path, message in _problems(obj)]
    return problems


def _problems(obj: dict) -> Iterator[tuple[str, str]]:
    """(json path, message) of each problem of one object."""
    api_version, kind = obj["apiVersion"], obj["kind"]
    group, _, version = api_version.rpartition("/")
    metadata = obj.get("metadata")
    name = metadata.get("name") if isinstance(metadata, dict) else None
    if isinstance(name, str) and (not _DNS_SUBDOMAIN.fullmatch(name) or len(name) > DNS_SUBDOMAIN_MAX):
        yield "metadata.name", f"{name!r} is not a DNS subdomain (lowercase letters, digits, '-' and '.')"
    if (group, kind) in CRD_FILES:
        validator = _crd_validator(group, kind, version)
        if validator is None:
            yield "apiVersion", f"no schema vendored for {api_version} {kind} (served: {_crd_served(group, kind)})"
            return
        found = list(_errors(validator, obj))
        yield from found
        if (group, kind) == ("jobset.x-k8s.io", "JobSet"):  # a field the CRD named already, said once
            yield from ((path, message) for path, message in _replicated_jobs(obj) if path not in dict(found))
        return
    validator = _core_validator(api_version, kind)
    if validator is None:
        yield "apiVersion", f"no schema vendored for {api_version} {kind}"
        return
    yield from _errors(validator, obj)


def _replicated_jobs(jobset: dict) -> Iterator[tuple[str, str]]:
    """Each replicated job's template as the ``batch/v1`` Job JobSet makes of it."""
    replicated = jobset.get("spec", {}).get("replicatedJobs")
    if not isinstance(replicated, list):
        return  # the CRD's check has said so
    validator = _core_validator("batch/v1", "Job")
    for index, entry in enumerate(replicated):
        template = entry.get("template") if isinstance(entry, dict) else None
        if not isinstance(template, dict):
            continue
        job = {"apiVersion": "batch/v1", "kind": "Job", **template}
        prefix = f"spec.replicatedJobs[{index}].template"
        for path, message in _errors(validator, job):
            yield f"{prefix}.{path}" if path else prefix, f"{message} (as a batch/v1 Job)"


def _errors(validator: Any, obj: dict) -> Iterator[tuple[str, str]]:
    for error in sorted(validator.iter_errors(obj), key=lambda e: list(map(str, e.absolute_path))):
        yield _json_path(error.absolute_path), error.message


def _json_path(parts: Iterable[str | int]) -> str:
    """``spec.containers[0].image``: how kubectl names a field."""
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _label(obj: dict) -> str:
    metadata = obj.get("metadata")
    name = metadata.get("name") if isinstance(metadata, dict) else None
    return f"{obj['kind']}/{name or '(no name)'}"


# CRDs -------------------------------------------------------------------------------------

@functools.cache
def _crd(group: str, kind: str) -> dict:
    yaml = require("yaml")
    text = resources.files(__package__).joinpath("schemas", CRD_FILES[(group, kind)]).read_text()
    return yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # the JobSet CRD is 0.8 MB


def _crd_served(group: str, kind: str) -> str:
    return ", ".join(f"{group}/{v['name']}" for v in _crd(group, kind)["spec"]["versions"])


@functools.cache
def _crd_validator(group: str, kind: str, version: str) -> Any:
    """The jsonschema validator of the CRD's ``openAPIV3Schema`` for ``version``, made strict;
    None when the CRD serves no such version."""
    jsonschema = require("jsonschema")
    for served in _crd(group, kind)["spec"]["versions"]:
        if served["name"] == version:
            return jsonschema.Draft7Validator(strict(served["schema"]["openAPIV3Schema"]))
    return None


def strict(schema: Any) -> Any:
    """A copy of an OpenAPI schema in which every object that lists its ``properties`` allows
    no others, unless it says so (``additionalProperties``) or keeps unknown fields
    (``x-kubernetes-preserve-unknown-fields``): what strict field validation enforces."""
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: strict(value) for key, value in schema.items()}
    if ("properties" in schema and "additionalProperties" not in schema
            and schema.get("x-kubernetes-preserve-unknown-fields") is not True):
        out["additionalProperties"] = False
    return out


# Kubernetes' own kinds -------------------------------------------------------------------

@functools.cache
def _core_validator(api_version: str, kind: str) -> Any:
    """The validator of kubernetes-validate's strict schema for the kind, None when it has none.

    Made once per kind (the shared definitions are 1.6 MB of JSON), where
    ``kubernetes_validate.validate`` would read them again for each object and stop at the
    first error; the files are the ones it reads, found by its own helpers."""
    utils = require("kubernetes_validate.utils")
    jsonschema, referencing = require("jsonschema"), require("referencing")
    directory = f"kubernetes-json-schema/v{_bundled_version(utils)}-local-strict"
    group_version = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)  # apps/v1 -> apps-v1
    try:
        schema = utils.schema_contents(f"{directory}/{kind.lower()}-{group_version}.json", KUBERNETES_VERSION)
    except FileNotFoundError:
        return None
    definitions = utils.schema_contents(f"{directory}/_definitions.json", KUBERNETES_VERSION)
    registry = referencing.Resource.from_contents(schema) @ referencing.Registry()
    registry = referencing.Resource.from_contents(definitions) @ registry  # the $refs' target
    return jsonschema.Draft202012Validator(schema, registry=registry)


def _bundled_version(utils: Any) -> str:
    """The newest bundled patch release of ``KUBERNETES_VERSION`` (its directories are per release)."""
    bundled = [v for v in utils.all_versions() if utils.major_minor(v) == KUBERNETES_VERSION]
    if not bundled:
        raise MissingExtra(
            f"kubernetes-validate bundles no schemas of Kubernetes {KUBERNETES_VERSION}: "
            "pip install --upgrade 'elasticft[kubernetes]'")
    return bundled[-1]
