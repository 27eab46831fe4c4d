"""Create (or update) the deployments `regen/local` and `regen/kimi-k3` on a Prefect process work pool.

    source scripts/prefect-env.sh && .venv/bin/python flows/deploy.py [--pool regen-local]

Both run the flow `regen` (`flows/regen_flow.py:regen`) from this checkout (the worker changes into the
repository root), with different default parameters; any parameter is overridable per run:

    prefect deployment run regen/local
    prefect deployment run regen/local --param run_dir=runs/demo --param overrides='{"select.total": 48}'
    prefect deployment run regen/kimi-k3 --param overrides='{"generate.endpoints": ["http://HOST:PORT/v1"]}'

`kimi-k3` reads its endpoints and API key from the worker's environment (`REGEN_ENDPOINTS`, `REGEN_API_KEY`,
`KIMI_K3_TOKENIZER`; see data/profiles/kimi-k3.yaml): secrets are never deployment parameters.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
ENTRYPOINT = "flows/regen_flow.py:regen"

# deployment name -> (default parameters, description)
DEPLOYMENTS: dict[str, tuple[dict, str]] = {
    "local": (
        {"profile": "local", "run_dir": "runs/local", "overrides": {}},
        "the embedded real model on loopback over the bundled prompts (a few hundred, every category)",
    ),
    "kimi-k3": (
        {"profile": "kimi-k3", "run_dir": "runs/kimi-k3", "overrides": {}},
        "production: moonshotai/Kimi-K3 at maximum thinking effort over REGEN_ENDPOINTS, 150,000 prompts, "
        "32K-token Kimi-K3 rows",
    ),
}


def ensure_pool(name: str) -> None:
    """Create the process work pool `name` unless it exists."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists

    with get_client(sync_client=True) as client:
        try:
            client.create_work_pool(WorkPoolCreate(name=name, type="process"))
        except ObjectAlreadyExists:
            pass


def deploy(pool: str, names: list[str] | None = None) -> list[str]:
    """Create/update the deployments `names` (default: all) on `pool`; returns their ids."""
    from prefect import flow

    ensure_pool(pool)
    source = flow.from_source(source=str(REPO_ROOT), entrypoint=ENTRYPOINT)
    ids = []
    for name in names or list(DEPLOYMENTS):
        params, description = DEPLOYMENTS[name]
        ids.append(str(source.deploy(
            name=name, work_pool_name=pool, parameters=params, description=description, tags=["regen", name],
            job_variables={"working_dir": str(REPO_ROOT)}, build=False, push=False, print_next_steps=False, ignore_warnings=True,
        )))
        print(f"deployment regen/{name} on work pool {pool}")
    return ids


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pool", default="regen-local", help="process work pool (created when missing)")
    p.add_argument("names", nargs="*", help=f"deployments to create, of {list(DEPLOYMENTS)} (default: all)")
    args = p.parse_args(argv)
    unknown = [n for n in args.names if n not in DEPLOYMENTS]
    if unknown:
        p.error(f"unknown deployments {unknown}; known: {list(DEPLOYMENTS)}")
    deploy(args.pool, args.names or None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
