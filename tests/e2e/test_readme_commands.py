"""The README's commands, run as written: only the port is made free and the paths temporary.

The commands are read from README.md itself, so that this breaks when the
README changes: `make serve ARGS=...` from "Run it", the Python block of "A
short client", `openrl-doctor --url ...` from "Operate it", `make
quickstart ARGS=...` from "The quickstart that learns", and `make sql-sweep
ARGS=...` and `make agentic ARGS=...` from "Two research workloads" (each with
a small step count). They run from the repository root in its .venv, as a user who has
run `make install` would; the node's data dir is given the run's SmolLM2
conversion first (conftest's `smollm2_conversion`), as a node that converted
it once finds it again, so the suite pays that minute only once.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import ServeCommand, seed_smollm2

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
README_URL = "http://127.0.0.1:8000"  # the address the README's commands use; a free port replaces it
COMMAND_TIMEOUT_S = 600


def _section(title: str) -> str:
    """The text of README section `## title`, up to the next one."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## )", README, re.M | re.S)
    assert match, f"README.md has no section {title!r}"
    return match.group(1)


def _fenced(section: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", section, re.M | re.S)


def _sh_commands(block: str) -> list[str]:
    """The commands of a ```sh block, comments stripped."""
    return [line.split("  #", 1)[0].strip() for line in block.splitlines() if line.strip()]


def _env() -> dict[str, str]:
    """A user's shell with the venv on PATH; not inside this run's own `make` (if any)."""
    env = {name: value for name, value in os.environ.items() if name not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    return {**env, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}", "PYTHONUNBUFFERED": "1"}


def _run(argv: list[str], **kwargs) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, **kwargs
    )


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, smollm2_conversion: Path) -> Iterator[str]:
    """The README's `make serve ARGS="--port 0 --data-dir /tmp/openrld"`, on a temporary data dir: its URL."""
    root = tmp_path_factory.mktemp("readme")
    (command,) = re.findall(r'`(make serve ARGS="[^"]*")`', _section("Run it"))
    assert command == 'make serve ARGS="--port 0 --data-dir /tmp/openrld"'
    argv = shlex.split(command.replace("/tmp/openrld", str(root / "openrld")))
    seed_smollm2(root / "openrld", smollm2_conversion)
    serve = ServeCommand(argv, root / "serve.log", env=_env(), cwd=REPO)
    url = serve.start()
    yield url
    assert serve.stop() is not None


def test_openrl_doctor_passes_every_check_against_a_fresh_default_node(node: str):
    (command,) = re.findall(r"`(openrl-doctor --url \S+)", _section("Operate it"))
    assert command == f"openrl-doctor --url {README_URL}"
    out = _run(shlex.split(command.replace(README_URL, node)))
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert [line.split()[:2] for line in lines[1:7]] == [
        ["OK", "reachability"], ["OK", "tls"], ["OK", "auth"], ["OK", "version"], ["OK", "cluster"], ["OK", "smoke"],
    ]
    assert lines[6].split(None, 2)[2].startswith("SmolLM2-135M-Instruct: LoRA rank 4, one step (loss ")
    assert lines[7] == "6 ok, 0 warnings, 0 failed, 0 skipped"


def test_the_short_client_trains_samples_saves_and_restores(node: str, tiny_llama: Path, tmp_path: Path):
    (block,) = _fenced(_section("A short client"), "python")
    assert f'base_url="{README_URL}"' in block and 'base_model="/path/to/hf-model-dir"' in block
    script = tmp_path / "client.py"
    script.write_text(block.replace(README_URL, node).replace("/path/to/hf-model-dir", str(tiny_llama)))
    out = _run(["python", str(script)])
    assert out.returncode == 0, out.stdout + out.stderr
    metrics, tokens = out.stdout.splitlines()
    assert sorted(ast.literal_eval(metrics)) == ["loss:sum", "tokens:sum"], metrics
    assert ast.literal_eval(metrics)["tokens:sum"] == 4.0  # the datum's four target tokens
    sequences = json.loads(tokens)
    assert len(sequences) == 4 and all(1 <= len(s) <= 16 for s in sequences), sequences


def test_make_quickstart_trains_a_step_and_writes_its_log_and_curve(node: str, tmp_path: Path):
    (block,) = _fenced(_section("The quickstart that learns"), "sh")
    serve, quickstart = _sh_commands(block)
    assert serve == "make serve"  # the `node` fixture is this, on a free port and a temporary data dir
    assert quickstart == f'make quickstart ARGS="--url {README_URL}"'
    argv = shlex.split(quickstart.replace(README_URL, node))
    small = "--steps 1 --problems-per-step 2 --group-size 2 --max-tokens 4"
    argv[-1] += f" {small} --out {tmp_path / 'quickstart_out'}"
    out = _run(argv)
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.search(r"^step   0  mean_reward [0-9.]+  full_marks", out.stdout, re.M), out.stdout
    assert "done: 1 steps in " in out.stdout
    records = (tmp_path / "quickstart_out" / "rewards.jsonl").read_text().splitlines()
    assert [json.loads(record)["step"] for record in records] == [0]
    assert (tmp_path / "quickstart_out" / "reward_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _workload_command(target: str) -> list[str]:
    """The README's `make <target> ARGS="--url ..."` line of "Two research workloads", as argv on `node`."""
    (block,) = _fenced(_section("Two research workloads"), "sh")
    [command] = [c for c in _sh_commands(block) if c.startswith(f"make {target} ")]
    assert command.startswith(f'make {target} ARGS="--url {README_URL} ')
    return shlex.split(command)


def test_make_sql_sweep_runs_a_job_and_writes_the_leaderboard_and_curves(node: str, tmp_path: Path):
    argv = _workload_command("sql-sweep")
    small = (
        "--steps 1 --eval-every 1 --jobs 1 --rounds 1 --lr 1e-3 --heldout-fraction 0.05 --questions-per-step 1"
        " --group-size 2 --max-tokens 16"
    )
    argv[-1] = argv[-1].replace(README_URL, node) + f" {small} --out {tmp_path / 'sql_sweep'}"
    out = _run(argv)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    markdown = (tmp_path / "sql_sweep" / "leaderboard.md").read_text()
    assert markdown.count("| r0-j") == 1 and "Exact McNemar test (two-sided)" in markdown
    assert (tmp_path / "sql_sweep" / "heldout_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_make_agentic_warm_starts_runs_a_step_in_bubblewrap_and_writes_its_records_and_curve(node: str, tmp_path: Path):
    if not Path("/usr/bin/bwrap").exists():
        pytest.skip("bubblewrap is missing (make install-test installs it)")
    argv = _workload_command("agentic")
    # A warm start of one step on two demonstrations (the expert's episodes need the README's turns and reply
    # tokens), one RL step, two episodes of one held-out task at each stage.
    small = (
        "--warm-start 2 --warm-start-steps 1 --warm-start-batch 2 --steps 1 --eval-every 1 --groups-per-step 1"
        " --group-size 2 --held-out-tasks 1 --held-out-episodes 2"
    )
    out_dir = tmp_path / "agentic"
    argv[-1] = argv[-1].replace(README_URL, node) + f" {small} --out {out_dir}"
    out = _run(argv)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    records = [json.loads(line) for line in (out_dir / "records.jsonl").read_text().splitlines()]
    assert (records[0]["type"], records[0]["sandbox_backend"]) == ("run", "bwrap")
    [warm] = [r for r in records if r["type"] == "warm_start"]
    evals = [r for r in records if r["type"] == "eval"]
    assert [(r["stage"], r["step"], len(r["successes"])) for r in evals] == [("base", 0, 2), ("warm_start", 0, 2),
                                                                             ("rl", 1, 2)]
    # RL resumed from the warm start's state, its Adam moments with it: the loop's own resume record.
    first = json.loads((out_dir / "cookbook" / "checkpoints.jsonl").read_text().splitlines()[0])
    assert (first["name"], first["batch"], first["state_path"]) == ("warm-start", 0, warm["state_path"])
    assert f"Resumed training from {warm['state_path']}" in (out_dir / "cookbook" / "logs.log").read_text()
    assert (out_dir / "held_out_success.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
