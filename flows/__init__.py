"""Prefect flows and deployments: thin wrappers over the `regen` stages (nothing else imports Prefect)."""
