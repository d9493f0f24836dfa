"""skills/openrl/SKILL.md names only endpoints, settings, options and metrics that the real daemon has."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import msgspec
import pytest

from openrld.config import NodeConfig
from openrld.doctor import main as doctor_main

SKILL = (Path(__file__).resolve().parents[1] / "skills" / "openrl" / "SKILL.md").read_text()
HEADERS = {"X-API-Key": "tml-test"}

ENDPOINTS = sorted(set(re.findall(r"`(GET|POST|PUT|DELETE) (/[^`\s]*)`", SKILL)))
NOT_BUILT = sorted(set(re.findall(r"`(/[^`\s]+)` \(not built yet\)", SKILL)))


def test_skill_has_the_agent_skill_front_matter():
    front = SKILL.split("---\n")[1]
    assert re.search(r"^name: openrl$", front, re.M)
    assert re.search(r"^description: .{40,}$", front, re.M)


def test_skill_names_the_status_endpoints():
    assert ("GET", "/openrl/v1/info") in ENDPOINTS and ("GET", "/metrics") in ENDPOINTS
    assert ("GET", "/openrl/v1/models/<model_id>/status") in ENDPOINTS
    assert ("GET", "/openrl/v1/cluster") in ENDPOINTS and NOT_BUILT == []


@pytest.mark.parametrize(("method", "path"), ENDPOINTS, ids=[f"{m} {p}" for m, p in ENDPOINTS])
def test_every_endpoint_the_skill_names_is_routed(shared_daemon, method, path):
    concrete = re.sub(r"<[^>]+>", "no-such-id", path)
    response = httpx.request(method, f"{shared_daemon.url}{concrete}", headers=HEADERS, timeout=30)
    # An unknown id may be 404, but never "no route": the path itself must exist.
    assert not response.text.startswith('{"detail":"no route'), response.text
    assert response.status_code != 405
    if "<" not in path:
        assert response.status_code == 200, response.text


@pytest.mark.parametrize("path", NOT_BUILT)
def test_what_the_skill_calls_not_built_is_not_built(shared_daemon, path):
    response = httpx.get(f"{shared_daemon.url}{path}", headers=HEADERS, timeout=30)
    assert response.json() == {"detail": f"no route GET {path}"}


def test_every_setting_the_skill_names_is_in_the_published_schema(shared_daemon):
    info = httpx.get(f"{shared_daemon.url}/openrl/v1/info", headers=HEADERS, timeout=30).json()
    published = set(info["settings_schema"]["$defs"]["JobSettings"]["properties"])
    named = set(re.findall(r"`openrl\.([a-z_]+)", SKILL))
    assert named == published


def test_every_config_option_the_skill_names_exists():
    fields = {f.name for f in msgspec.structs.fields(NodeConfig)}
    # max_context_length is a model's field (checked below), not an option.
    named = set(re.findall(r"`((?:max_|sample_queue|log_json|api_keys)\w*)", SKILL)) - {"max_context_length"}
    assert named and named <= fields, named - fields


def test_every_metric_the_skill_names_is_exported(shared_daemon):
    text = httpx.get(f"{shared_daemon.url}/metrics", timeout=30).text
    families = set(re.findall(r"^# TYPE (\w+) ", text, re.M))
    named = set(re.findall(r"`(openrld_\w+)`", SKILL))
    assert named and named <= families, named - families


def test_every_info_field_the_skill_names_is_in_the_info_body(shared_daemon):
    info = httpx.get(f"{shared_daemon.url}/openrl/v1/info", headers=HEADERS, timeout=30).json()
    named = {"settings_schema", "trainer_backends", "sampler_backends", "losses", "refused_losses", "limits",
             "models", "devices", "tinker_sdk_version"}
    assert all(f"`{name}`" in SKILL for name in named)
    assert named <= set(info)
    assert "`max_context_length`" in SKILL and all("max_context_length" in model for model in info["models"])


def test_every_doctor_flag_the_skill_uses_exists(capsys):
    with pytest.raises(SystemExit):
        doctor_main(["--help"])
    help_text = capsys.readouterr().out
    flags = set(re.findall(r"(?<=\s)(--[a-z][a-z-]+)", SKILL.split("## 5. Run openrl-doctor")[1].split("## 6.")[0]))
    assert flags == {"--url", "--api-key", "--ca-cert", "--no-smoke", "--model", "--json"}
    assert all(flag in help_text for flag in flags)
