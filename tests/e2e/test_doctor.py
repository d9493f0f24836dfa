"""openrl-doctor against real daemons: a healthy open-mode node, a key-mode node with a bad key, and no node.

The last part runs the installed console script in a subprocess once per flag
(and for TINKER_API_KEY, its one environment variable; it has no config file).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import Daemon, write_api_keys, write_config  # the suite's real-daemon helpers

from openrld.doctor import Status, main

KEY = "tml-doctor-test-key"
DOCTOR = str(Path(sys.executable).with_name("openrl-doctor"))


def _results(capsys, argv: list[str]) -> tuple[int, dict[str, dict]]:
    code = main([*argv, "--json"])
    report = json.loads(capsys.readouterr().out)
    return code, {check["name"]: check for check in report["checks"]}


def test_healthy_open_node_passes_every_check_and_exits_0(shared_daemon, capsys):
    code, checks = _results(capsys, ["--url", shared_daemon.url])
    assert code == 0
    assert {name: check["status"] for name, check in checks.items()} == {
        "reachability": "ok", "tls": "ok", "auth": "ok", "version": "ok", "cluster": "ok", "smoke": "ok",
    }
    assert checks["auth"]["summary"] == "open mode: the node needs no key (it serves loopback only)"
    assert checks["cluster"]["summary"].startswith("single node (no cluster_secret, so in no cluster)")
    assert checks["smoke"]["summary"].startswith("tiny-llama: LoRA rank 4, one step (loss ")
    assert "sampled 4 tokens, session closed" in checks["smoke"]["summary"]


def _doctor(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The console script as a user runs it, without a TINKER_API_KEY of this process's own."""
    base = {name: value for name, value in os.environ.items() if name != "TINKER_API_KEY"}
    return subprocess.run([DOCTOR, *args], capture_output=True, text=True, timeout=300, env={**base, **(env or {})})


def _json_checks(out: subprocess.CompletedProcess[str]) -> dict[str, dict]:
    return {check["name"]: check for check in json.loads(out.stdout)["checks"]}


def test_report_is_readable_text_with_one_line_per_check(shared_daemon):
    out = _doctor("--url", shared_daemon.url, "--no-smoke")
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == f"openrl-doctor {shared_daemon.url}"
    assert [line.split()[:2] for line in lines[1:7]] == [
        ["OK", "reachability"], ["OK", "tls"], ["OK", "auth"], ["OK", "version"], ["OK", "cluster"], ["SKIP", "smoke"],
    ]
    assert lines[7] == "5 ok, 0 warnings, 0 failed, 1 skipped"


@pytest.fixture(scope="module")
def key_daemon(tmp_path_factory, tiny_llama):
    """A key-mode daemon shared by this module's auth tests (one start instead of one per test)."""
    root = tmp_path_factory.mktemp("key-daemon")
    keys = write_api_keys(root / "keys.toml", {KEY: "alice"})
    config = write_config(root / "openrld.toml", root / "data", {"tiny-llama": tiny_llama}, f'api_keys_file = "{keys}"')
    daemon = Daemon(root / "data", config, root / "daemon.log").start()
    yield daemon
    daemon.stop()


def test_refused_key_fails_auth_says_what_to_do_and_exits_1(key_daemon, capsys):
    code, checks = _results(capsys, ["--url", key_daemon.url, "--api-key", "tml-wrong"])
    assert code == 1
    assert checks["auth"] == {
        "name": "auth", "status": "fail",
        "summary": "the API key given was refused: unknown API key",
        "next_step": "pass --api-key (or set TINKER_API_KEY) to a key listed in the node's api_keys_file",
    }
    assert [checks[name]["status"] for name in ("version", "cluster", "smoke")] == ["skip", "skip", "skip"]


def test_accepted_key_passes_auth_in_key_mode(key_daemon, capsys):
    code, checks = _results(capsys, ["--url", key_daemon.url, "--api-key", KEY, "--no-smoke"])
    assert code == 0
    assert checks["auth"]["summary"] == "API key accepted"


def test_unreachable_url_fails_reachability_and_skips_the_rest(capsys):
    with socket.socket() as sock:  # a port that was free a moment ago, with nothing listening
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    code, checks = _results(capsys, ["--url", f"http://127.0.0.1:{port}"])
    assert code == 1
    assert checks["reachability"]["status"] == Status.FAIL.value
    assert checks["reachability"]["summary"].startswith(f"cannot connect to http://127.0.0.1:{port}")
    assert checks["reachability"]["next_step"].startswith("check that `openrld serve` runs there")
    assert {checks[n]["status"] for n in ("tls", "auth", "version", "cluster", "smoke")} == {"skip"}


def test_bad_url_is_a_usage_error_with_status_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--url", "127.0.0.1:8000"])
    assert exit_info.value.code == 2
    assert "--url: expected http://HOST:PORT" in capsys.readouterr().err


# ---------------------------------------------------------------- each flag of the console script


def test_json_flag_prints_one_json_object_with_every_check(shared_daemon):
    out = _doctor("--url", shared_daemon.url, "--no-smoke", "--json")
    report = json.loads(out.stdout)
    assert (out.returncode, report["url"], report["ok"]) == (0, shared_daemon.url, True)
    assert [(c["name"], c["status"]) for c in report["checks"]] == [
        ("reachability", "ok"), ("tls", "ok"), ("auth", "ok"), ("version", "ok"), ("cluster", "ok"), ("smoke", "skip"),
    ]
    assert report["checks"][-1]["summary"] == "skipped (--no-smoke)"


def test_model_flag_runs_the_smoke_on_that_model(shared_daemon):
    out = _doctor("--url", shared_daemon.url, "--model", "tiny-qwen3", "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    assert _json_checks(out)["smoke"]["summary"].startswith("tiny-qwen3: LoRA rank 4, one step (loss ")


def test_model_flag_naming_a_model_not_served_fails_the_smoke_with_the_served_ones(shared_daemon):
    out = _doctor("--url", shared_daemon.url, "--model", "org/not-here", "--json")
    assert out.returncode == 1
    assert _json_checks(out)["smoke"]["summary"] == (
        "--model 'org/not-here' is not served here; served: tiny-llama, tiny-qwen3, SmolLM2-135M-Instruct, "
        "HuggingFaceTB/SmolLM2-135M-Instruct, gemma-3-270m, google/gemma-3-270m"
    )


def test_api_key_flag_is_accepted_by_a_key_mode_node(key_daemon):
    out = _doctor("--url", key_daemon.url, "--api-key", KEY, "--no-smoke", "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    assert _json_checks(out)["auth"]["summary"] == "API key accepted"


def test_tinker_api_key_variable_stands_in_for_the_api_key_flag(key_daemon):
    out = _doctor("--url", key_daemon.url, "--no-smoke", "--json", env={"TINKER_API_KEY": KEY})
    assert out.returncode == 0, out.stdout + out.stderr
    assert _json_checks(out)["auth"]["summary"] == "API key accepted"


def test_ca_cert_flag_that_names_no_pem_file_is_a_usage_error_with_status_2(tmp_path):
    (tmp_path / "not-a-ca.pem").write_text("not a certificate\n")
    out = _doctor("--url", "https://127.0.0.1:1", "--ca-cert", str(tmp_path / "not-a-ca.pem"))
    assert (out.returncode, out.stdout) == (2, "")
    assert f"openrl-doctor: error: --ca-cert: cannot read '{tmp_path / 'not-a-ca.pem'}' as PEM CA certificates" in out.stderr
