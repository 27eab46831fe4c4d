"""The embedded target: a real small model behind a real OpenAI-compatible server, on loopback.

`EmbeddedTarget(cfg)` starts `transformers serve <model> --device cpu --continuous-batching --host 127.0.0.1`
(transformers' own FastAPI/uvicorn server: `/v1/chat/completions` streaming and not, `/v1/models`, `/health`)
as a child process, waits until `/v1/models` lists the model, sends one warm-up request, and on exit stops the
process group (SIGTERM, then SIGKILL after `stop_timeout_s`). The child also gets SIGTERM if this process dies
(Linux `PR_SET_PDEATHSIG`), so a killed worker leaves no server behind. The model id is the model directory's
name (`smollm2-135m`): the server is pinned to it and answers 400 to any other `model`.

What the server does with a request (transformers 5.24, measured; README "The embedded target"):
- honours `max_tokens` / `max_completion_tokens` per request, `stop` (as stop strings), streaming with `usage`
  in the last chunk; `finish_reason` is `stop` or `length`.
- sampling (`temperature`, `top_p`) is shared by the whole continuous batch and fixed by its *first* request
  (`transformers.cli.serving.utils.CBGenerateManager`); later requests' values are ignored. So the warm-up request
  carries the run's sampling (`EmbeddedTarget(cfg, sampling=...)`; `regen run` passes `generate.temperature` and
  `generate.top_p`), and every request of the run carries the same. The prepared model's generation config has
  `do_sample: true` (regen.serve.prepare_model.SAMPLING_DEFAULTS): temperature > 0 samples, 0 is greedy
  (deterministic). `frequency_penalty` (repetition penalty) is dropped under continuous batching.
- returns no `reasoning_content` (neither embedded model produces it) and no token ids; unknown body fields (e.g. `return_token_ids`,
  `thinking`) are rejected with 422.

CLI: `regen serve-target --profile local [--port 8431]` serves until Ctrl-C.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from regen.config.serve import ServeConfig
from regen.errors import InputError

_PR_SET_PDEATHSIG = 1


class TargetStartError(RuntimeError):
    """The server did not become ready: the message holds the command, the exit code and the log's tail."""


def free_port(host: str = "127.0.0.1") -> int:
    """A free TCP port on `host` (bound then released; a small race is possible, start retries once)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # runs in the child between fork and exec
    os.setsid()
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def server_command(cfg: ServeConfig, model_name: str, port: int) -> list[str]:
    """The `transformers serve` argv for `cfg` (run with cwd = the model directory's parent)."""
    exe = Path(sys.executable).with_name("transformers")
    cmd = [str(exe) if exe.exists() else "transformers", "serve", model_name, "--device", cfg.device,
           "--host", cfg.host, "--port", str(port), "--log-level", cfg.log_level]
    if cfg.continuous_batching:
        cmd.append("--continuous-batching")
        if cfg.cb_num_blocks:
            cmd += ["--cb-num-blocks", str(cfg.cb_num_blocks)]
        if cfg.cb_max_batch_tokens:
            cmd += ["--cb-max-batch-tokens", str(cfg.cb_max_batch_tokens)]
    return cmd + list(cfg.extra_args)


def sampling(generate) -> dict:
    """The sampling fields every request of the run sends (`regen.generate.conversation.sampling_params`), less
    `max_tokens`: what the warm-up must carry to fix the served batch's sampling (module docstring)."""
    from regen.generate.conversation import sampling_params

    return {k: v for k, v in sampling_params(generate).items() if k != "max_tokens"}


class EmbeddedTarget:
    """Context manager: the embedded target server on loopback.

    Attributes after `__enter__` (or `start()`): `base_url` ("http://127.0.0.1:PORT/v1"), `model` (the id to
    request, e.g. "smollm2-135m"), `port`, `pid`, `log_path` (the server's stdout+stderr, one access line per
    request at log level info), `ready_s` (seconds from start to ready, warm-up included).

    Raises InputError when the model directory is missing (run `bash scripts/setup.sh`) and TargetStartError
    when the server exits or is not ready within `cfg.ready_timeout_s`.
    """

    def __init__(self, cfg: ServeConfig, *, log_path: str | Path | None = None, stop_timeout_s: float = 15.0,
                 sampling: dict | None = None):
        from regen.config import resolve_path

        self.cfg = cfg
        # the batch's sampling, fixed by the warm-up request (module docstring); greedy unless given
        self.sampling = {"temperature": 0.0, **(sampling or {})}
        self.model_dir = resolve_path(cfg.model_dir)
        self.model = self.model_dir.name
        self.log_path = Path(log_path) if log_path else Path(tempfile.mkdtemp(prefix="regen-serve-")) / "server.log"
        self.stop_timeout_s = stop_timeout_s
        self.proc: subprocess.Popen | None = None
        self.port: int | None = None
        self.ready_s: float | None = None

    @property
    def base_url(self) -> str:
        host = f"[{self.cfg.host}]" if ":" in self.cfg.host else self.cfg.host
        return f"http://{host}:{self.port}/v1"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self) -> "EmbeddedTarget":
        if not (self.model_dir / "config.json").exists():
            raise InputError(
                f"embedded target model {self.model_dir} not found (serve.model_dir): run `bash scripts/setup.sh` "
                "or `.venv/bin/python -m regen.serve.prepare_model`"
            )
        t0 = time.monotonic()
        for attempt in range(2):
            self.port = self.cfg.port or free_port(self.cfg.host)
            self._spawn()
            try:
                self._wait_ready(t0)
                break
            except TargetStartError:
                self.stop()
                if attempt == 1 or self.cfg.port:
                    raise
        if self.cfg.warmup:
            self.chat([{"role": "user", "content": "Hello"}], max_tokens=1, **self.sampling)
        self.ready_s = time.monotonic() - t0
        return self

    def _spawn(self) -> None:
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1",
                   DO_NOT_TRACK="1", PYTHONUNBUFFERED="1")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen(
                server_command(self.cfg, self.model, self.port), cwd=self.model_dir.parent, env=env,
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent,
            )
        finally:
            log.close()

    def _wait_ready(self, t0: float) -> None:
        import httpx

        url = self.base_url + "/models"
        while True:
            code = self.proc.poll()
            if code is not None:
                raise TargetStartError(self._failure(f"the server exited with code {code}"))
            if time.monotonic() - t0 > self.cfg.ready_timeout_s:
                raise TargetStartError(self._failure(f"not ready after {self.cfg.ready_timeout_s:.0f}s"))
            try:
                r = httpx.get(url, timeout=2.0)
                if r.status_code == 200 and any(m.get("id") == self.model for m in r.json().get("data", [])):
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.25)

    def _failure(self, what: str) -> str:
        tail = self.log_path.read_text(errors="replace")[-3000:] if self.log_path.exists() else ""
        cmd = " ".join(server_command(self.cfg, self.model, self.port))
        return f"embedded target {what}: {cmd} (cwd {self.model_dir.parent})\n--- {self.log_path} (tail) ---\n{tail}"

    def chat(self, messages: list[dict], **params) -> dict:
        """One non-streaming chat completion (for warm-up and checks). Returns the response JSON."""
        import httpx

        body = {"model": self.model, "messages": messages, **self.sampling, **params}
        r = httpx.post(self.base_url + "/chat/completions", json=body, timeout=self.cfg.ready_timeout_s)
        if r.status_code != 200:
            raise TargetStartError(self._failure(f"answered {r.status_code} to a chat request: {r.text[:500]}"))
        return r.json()

    def stop(self) -> None:
        """SIGTERM the server's process group, SIGKILL it after `stop_timeout_s`; idempotent."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, self.stop_timeout_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        try:  # stragglers of the group (none are expected: the server is one process)
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def __enter__(self) -> "EmbeddedTarget":
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()

    def request_count(self) -> int:
        """Chat completion requests the server has logged so far (its access log; needs log level info)."""
        if not self.log_path.exists():
            return 0
        return sum(1 for line in self.log_path.read_text(errors="replace").splitlines()
                   if '"POST /v1/chat/completions' in line)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from regen.config import add_profile_arguments

    add_profile_arguments(parser, run_required=False)
    parser.add_argument("--port", type=int, default=None, help="port (default: serve.port; 0 = a free port)")
    parser.add_argument("--log", default=None, help="server log file (default: a temporary file)")
    parser.add_argument("--check", action="store_true", help="start, answer one request, print it, stop")


def main(args) -> int:
    from regen.config import load_profile

    profile = load_profile(args.profile, args.overrides)
    cfg = profile.serve if args.port is None else profile.serve.model_copy(update={"port": args.port})
    with EmbeddedTarget(cfg, log_path=args.log, sampling=sampling(profile.generate)) as target:
        info = {"base_url": target.base_url, "model": target.model, "pid": target.pid,
                "log": str(target.log_path), "ready_s": round(target.ready_s, 1)}
        print(json.dumps(info), flush=True)
        if args.check:
            reply = target.chat([{"role": "user", "content": "Name three colors."}], max_tokens=16)
            print(json.dumps(reply, ensure_ascii=False), flush=True)
            return 0
        stop = {"now": False}

        def _stop(*_):
            stop["now"] = True

        signal.signal(signal.SIGTERM, _stop)
        try:
            while not stop["now"]:
                if target.proc is None or target.proc.poll() is not None:
                    print(f"regen serve-target: the server exited; log: {target.log_path}", file=sys.stderr)
                    return 1
                time.sleep(0.5)
        except KeyboardInterrupt:
            pass
    return 0
