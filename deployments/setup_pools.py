"""Create or update eaglenest's work pools: two GPU pools limited to one flow run at a time, one control pool.

    PREFECT_API_URL=http://host:4200/api python deployments/setup_pools.py [--limit 1] [--docker-image IMG]

Owns the pools named in ``deployments/prefect.yaml``:

- ``gpu-process`` (type process): a worker in a checkout on the GPU host.
- ``eaglenest-control`` (type process, no limit): where ``pipeline-fanout`` runs; it only dispatches and waits.
- ``gpu-docker`` (type docker): Prefect 3.9.1's bundled Docker job template plus one variable,
  ``container_create_kwargs`` (prefect-docker's worker passes it to docker-py ``containers.create``), whose
  default requests every GPU (``device_requests``) and a 32 GB ``/dev/shm``. Needs no Docker engine here:
  the template comes from the metadata bundled with Prefect, so this runs offline.

Invariants: idempotent (a second run changes nothing and exits 0); an existing pool keeps its template and
customisations, only the concurrency limit is set and a missing ``container_create_kwargs`` added; the limit
is a work-pool concurrency limit, so queued runs wait in the pool instead of sharing the GPUs.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import sys

from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import WorkPoolCreate, WorkPoolUpdate
from prefect.exceptions import ObjectNotFound
from prefect.workers.utilities import get_default_base_job_template_for_infrastructure_type

PROCESS_POOL, DOCKER_POOL, CONTROL_POOL = "gpu-process", "gpu-docker", "eaglenest-control"
DEFAULT_CONTAINER_KWARGS = {
    "shm_size": "32g",
    "ipc_mode": "host",
    "device_requests": [{"driver": "nvidia", "count": -1, "capabilities": [["gpu"]]}],
}


def docker_template(base: dict, image: str | None) -> dict:
    """``base`` (a docker base job template) with ``container_create_kwargs`` wired in; ``image`` as default."""
    tpl = copy.deepcopy(base)
    tpl["job_configuration"].setdefault("container_create_kwargs", "{{ container_create_kwargs }}")
    props = tpl["variables"].setdefault("properties", {})
    props.setdefault("container_create_kwargs", {
        "title": "Container create kwargs",
        "description": ("Extra docker-py containers.create() arguments: GPUs (device_requests), shm_size, "
                        "ipc_mode, ulimits. Default: every GPU, 32 GB /dev/shm, host IPC (SGLang, NCCL)."),
        "type": "object",
        "default": DEFAULT_CONTAINER_KWARGS,
    })
    if image:
        props.setdefault("image", {"type": "string"})["default"] = image
    return tpl


async def _default_template(pool_type: str) -> dict:
    tpl = await get_default_base_job_template_for_infrastructure_type(pool_type)
    if not tpl:
        raise SystemExit(f"setup_pools: Prefect knows no base job template for pool type {pool_type!r}; "
                         "upgrade prefect or pass a template with `prefect work-pool create --base-job-template`")
    return tpl


async def ensure_pool(client, name: str, pool_type: str, limit: int | None, image: str | None = None) -> str:
    """Create pool ``name`` or update it in place; returns what was done (for the log line)."""
    try:
        pool = await client.read_work_pool(name)
    except ObjectNotFound:
        tpl = await _default_template(pool_type)
        if pool_type == "docker":
            tpl = docker_template(tpl, image)
        await client.create_work_pool(WorkPoolCreate(name=name, type=pool_type, base_job_template=tpl,
                                                     concurrency_limit=limit,
                                                     description=f"eaglenest {name} ({pool_type})"))
        return "created"
    if pool.type != pool_type:
        raise SystemExit(f"setup_pools: pool {name!r} exists with type {pool.type!r}, expected {pool_type!r}; "
                         "delete it (`prefect work-pool delete`) or rename ours in deployments/prefect.yaml")
    update: dict = {}
    if limit is not None and pool.concurrency_limit != limit:  # None: the control pool's limit is left alone
        update["concurrency_limit"] = limit
    if pool_type == "docker":
        tpl = docker_template(pool.base_job_template, None)
        if tpl != pool.base_job_template:
            update["base_job_template"] = tpl
    if not update:
        return "unchanged"
    await client.update_work_pool(name, WorkPoolUpdate(**update))
    return "updated " + ", ".join(sorted(update))


async def setup(limit: int = 1, image: str | None = "eaglenest:0.1.0") -> dict[str, str]:
    async with get_client() as client:
        return {PROCESS_POOL: await ensure_pool(client, PROCESS_POOL, "process", limit),
                DOCKER_POOL: await ensure_pool(client, DOCKER_POOL, "docker", limit, image),
                CONTROL_POOL: await ensure_pool(client, CONTROL_POOL, "process", None)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", type=int, default=1, help=(
        "flow runs at once per GPU pool: the number of GPU hosts serving it, each worker started with --limit 1 "
        "(default 1)"))
    ap.add_argument("--docker-image", default="eaglenest:0.1.0", help="default image of the docker pool")
    args = ap.parse_args(argv)
    if args.limit < 1:
        ap.error("--limit must be >= 1")
    for name, what in asyncio.run(setup(args.limit, args.docker_image)).items():
        print(f"work pool {name}: {what} (concurrency limit {args.limit if name != CONTROL_POOL else 'none'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
