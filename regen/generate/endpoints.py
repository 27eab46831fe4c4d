"""What `regen generate` needs before its first request: endpoints that answer, accept the key and serve the model.

    endpoint_problems(urls, model, api_key, timeout_s) -> one line per endpoint that fails (empty: all good)
    require_endpoints(urls, model, api_key, timeout_s)  -> raises EndpointsRefused listing every problem

Every entry that sends chat requests runs it first (`regen.generate.stage.run_generate`: `regen generate`, `regen
run`, `regen plan --pilot`, the flow's generate task), so a wrong model name or key costs 0 requests, not a
night of error rows. It checks only what generation needs: a generation-only node has no tokenizer or target
checkpoint. `regen.preflight` reuses `models_problem` for the whole profile's check. The only network call is
`GET {base}/models` (OpenAI API reference, "List models").
"""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from regen.errors import InputError


class EndpointsRefused(InputError):
    """Endpoints that cannot serve the run (`problems`: one line each, naming the endpoint and the fix)."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__(f"generate: {len(problems)} endpoint problem(s); nothing was requested:\n"
                         + "\n".join(f"  - {p}" for p in problems))


def models_problem(base_url: str, model: str, api_key: str | None, timeout_s: float) -> str | None:
    """Ask `GET {base_url}/models`; None when it answers 200 and lists `model`, else the problem in one line
    (unreachable, key rejected (401/403), another status, or the model missing from the list)."""
    from regen.generate.client import redact_url

    url = base_url.rstrip("/") + "/models"
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    shown = redact_url(base_url)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            body = resp.read()
    except urllib.error.HTTPError as exc:
        if exc.code in (401, 403):
            return (f"endpoint {shown}: the API key was rejected (HTTP {exc.code} on GET /models); check the key "
                    "in the variable named by generate.api_key_env")
        return f"endpoint {shown}: GET /models answered HTTP {exc.code}; is this an OpenAI-compatible server?"
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        return f"endpoint {shown}: unreachable ({reason}); check generate.endpoints and that the server is up"
    try:
        ids = [m.get("id") for m in json.loads(body).get("data", [])]
    except (ValueError, AttributeError, TypeError):
        return f"endpoint {shown}: GET /models did not return an OpenAI model list"
    if model not in ids:
        return (f"endpoint {shown}: serves {ids[:8]}, not generate.model {model!r}; fix generate.model "
                "(--set generate.model=...) or the endpoint")
    return None


def endpoint_problems(urls: list[str], model: str, api_key: str | None, timeout_s: float) -> list[str]:
    """Every endpoint's /models asked in parallel (16 at a time); one problem line per failing endpoint."""
    with ThreadPoolExecutor(max_workers=min(16, max(1, len(urls)))) as pool:
        answers = list(pool.map(lambda u: models_problem(u, model, api_key, timeout_s), urls))
    return [p for p in answers if p]


def require_endpoints(urls: list[str], model: str, api_key: str | None, timeout_s: float) -> None:
    """Raise EndpointsRefused (an InputError) naming every endpoint that cannot serve `model`; return when all can."""
    problems = endpoint_problems(urls, model, api_key, timeout_s)
    if problems:
        raise EndpointsRefused(problems)
