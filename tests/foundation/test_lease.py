"""One writer per stage and run directory: a lease naming host, process and since when."""
from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time

import pytest

from regen.rundir import Lease, LeaseError, LeaseHeld, check_exclusive_create, check_not_held, read_lease


def test_a_second_writer_exits_at_once_naming_the_holder(tmp_path):
    with Lease(tmp_path, "train") as first:
        record = read_lease(tmp_path, "train")
        assert record["pid"] == os.getpid() and record["host"] == socket.gethostname()
        assert record["expires"] > record["since"] and record["token"] == first.token
        with pytest.raises(LeaseHeld) as e:
            Lease(tmp_path, "train").acquire()
        msg = str(e.value)
        assert f"pid {os.getpid()}" in msg and socket.gethostname() in msg and "since" in msg
    assert read_lease(tmp_path, "train") is None  # released
    with Lease(tmp_path, "train"):
        pass


def _write(tmp_path, name, **fields):
    now = time.time()
    rec = {"stage": name.split("-")[0], "host": "other-host", "pid": 4242, "since": now - 600, "renewed": now - 120,
           "expires": now - 60, "ttl_s": 60, "token": "x", **fields}
    (tmp_path / f".lease-{name}.json").write_text(json.dumps(rec))
    return rec


def test_an_expired_lease_is_taken_over_with_a_message(tmp_path, caplog):
    _write(tmp_path, "render")
    with caplog.at_level(logging.WARNING):
        with Lease(tmp_path, "render") as lease:
            assert lease.took_over["host"] == "other-host" and "expired" in lease.took_over["why"]
            assert read_lease(tmp_path, "render")["token"] == lease.token
    assert "took over the stale lease" in caplog.text and "other-host" in caplog.text


def test_a_live_lease_of_another_host_is_not_taken_over(tmp_path):
    _write(tmp_path, "select", expires=time.time() + 600)
    with pytest.raises(LeaseHeld, match="host other-host pid 4242"):
        Lease(tmp_path, "select").acquire()


@pytest.mark.integration
def test_a_lease_of_a_dead_process_on_this_host_is_taken_over_before_expiry(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    _write(tmp_path, "train", host=socket.gethostname(), pid=dead.pid, expires=time.time() + 600)
    with Lease(tmp_path, "train") as lease:
        assert "is gone" in lease.took_over["why"]


def test_the_lease_is_renewed_while_the_stage_runs(tmp_path):
    with Lease(tmp_path, "generate", ttl_s=0.3) as lease:
        first = read_lease(tmp_path, "generate")["renewed"]
        deadline = time.time() + 30  # polled, never timed: the renewal thread runs every ttl/3
        while (read_lease(tmp_path, "generate") or {}).get("renewed", first) == first and time.time() < deadline:
            time.sleep(0.05)
        assert read_lease(tmp_path, "generate")["renewed"] > first and not lease.lost


def test_a_filesystem_without_exclusive_create_is_named(tmp_path, monkeypatch):
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda path, flags, *a: real_open(path, flags & ~os.O_EXCL, *a))
    with pytest.raises(LeaseError, match="does not honour exclusive file creation"):
        check_exclusive_create(tmp_path)


def test_select_refuses_while_generate_holds_the_run(tmp_path):
    from regen.config import load_profile
    from regen.rundir import RunDir
    from regen.select.stage import run_select

    with Lease(tmp_path, "generate", name="generate-generations"):
        with pytest.raises(LeaseHeld, match="`regen generate` on host"):
            run_select(load_profile("local").select, RunDir.at(tmp_path), seed=0)
    _write(tmp_path, "select", expires=time.time() + 600)
    with pytest.raises(LeaseHeld, match="`regen select` on host other-host"):
        check_not_held(tmp_path, "select", by="generate")


@pytest.mark.integration
def test_render_and_train_refuse_a_second_writer(tmp_path):
    from regen.config import load_profile
    from regen.render.stage import run_render
    from regen.rundir import RunDir
    from regen.train.loop import run_train

    _write(tmp_path, "render-shards", expires=time.time() + 600)
    with pytest.raises(LeaseHeld, match="other-host"):
        run_render(load_profile("local").render, RunDir.at(tmp_path))
    (tmp_path / "train").mkdir()
    _write(tmp_path / "train", "train", expires=time.time() + 600)
    cfg = load_profile("local", {"train.target": str(tmp_path)}).train
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(LeaseHeld, match="`regen train` on host other-host pid 4242"):
        run_train(cfg.model_copy(update={"device": "cpu"}), RunDir.at(tmp_path))


def test_generate_refuses_while_select_holds_the_run_and_a_second_generate(tmp_path):
    from regen.config import load_profile
    from regen.generate.stage import prepare
    from regen.rundir import RunDir

    cfg, run = load_profile("local").generate, RunDir.at(tmp_path)
    assert prepare(cfg, run)["recovered"] is not None  # nothing held: it runs and releases its lease
    assert not list(tmp_path.glob(".lease-*"))
    with Lease(tmp_path, "select"):
        with pytest.raises(LeaseHeld, match="`regen select` on host"):
            prepare(cfg, run)
    _write(tmp_path, "generate-generations", expires=time.time() + 600)  # another host's generate
    with pytest.raises(LeaseHeld, match="`regen generate` on host other-host pid 4242"):
        prepare(cfg, run)
