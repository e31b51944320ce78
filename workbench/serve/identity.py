"""Which deployment an endpoint's registry row, its folder and a handle belong to.

A name outlives its endpoints: after ``workbench undeploy NAME``, ``deploy(..., name=NAME)`` makes a
new endpoint under the same registry key and in the same folder (``WORKBENCH_HOME/endpoints/NAME``).
So each deploy gets an id of its own (its *deployment*), written into the folder's
``deployment.json`` before anything else and into the registry row. A handle made for one
deployment acts (stops, loads adapters, writes the registry, connects) only while the row and the
folder still carry its id: :func:`own_record` checks both, and the registry's
``update_endpoint(..., deployment=...)`` writes only to the row of that deployment.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from workbench.errors import EndpointReplacedError

if TYPE_CHECKING:
    from workbench.runs.registry import EndpointRecord

DEPLOYMENT_FILE = "deployment.json"


def new_deployment(workdir: Path) -> str:
    """A fresh id for the deploy that is writing the endpoint folder ``workdir``; recorded there."""
    from workbench.runs.rundir import write_json_atomic

    deployment = uuid.uuid4().hex
    write_json_atomic(workdir / DEPLOYMENT_FILE, {"deployment": deployment, "time": time.time()})
    return deployment


def folder_deployment(endpoint_dir: str | Path) -> str | None:
    """The deployment whose files the endpoint folder holds; None when it records none (no
    readable deployment.json)."""
    try:
        data = json.loads((Path(endpoint_dir) / DEPLOYMENT_FILE).read_text(encoding="utf-8"))
        return str(data["deployment"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def folder_is_of(record: Any) -> bool:
    """Whether ``record``'s endpoint folder holds its deployment's files (and not a newer
    deploy's of the same name). A folder that records no deployment cannot say otherwise."""
    found = folder_deployment(record.endpoint_dir)
    return found is None or found == getattr(record, "deployment", None)


def own_record(mine: EndpointRecord, current: EndpointRecord) -> EndpointRecord:
    """``current`` (the registry's row of ``mine.name`` now), if it and the folder still describe
    the deployment of ``mine``; else EndpointReplacedError."""
    if current.deployment != mine.deployment or not folder_is_of(mine):
        raise _replaced(mine)
    return current


def _replaced(mine: EndpointRecord) -> EndpointReplacedError:
    name = mine.name
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(mine.created))
    return EndpointReplacedError(
        f"endpoint {name!r} deployed at {started}, which this handle was made for, is gone and "
        f"the name now belongs to a newer deployment; this handle changed nothing. Get the "
        f"current endpoint with workbench.serve.get_endpoint({name!r}) (or `workbench "
        "endpoints`), and act on that one")
