"""systemd/openrld.service passes `systemd-analyze verify` and keeps its state dir, restart rule and hardening."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

UNIT = Path(__file__).resolve().parents[2] / "systemd" / "openrld.service"
INSTALLED_OPENRLD = "/opt/openrld/venv/bin/openrld"


def _service_entries() -> list[tuple[str, str]]:
    """The [Service] section's key=value lines in order; systemd allows a key more than once."""
    entries, section = [], None
    for line in UNIT.read_text().splitlines():
        line = line.strip()
        if line.startswith("["):
            section = line
        elif section == "[Service]" and line and not line.startswith("#"):
            key, _, value = line.partition("=")
            entries.append((key, value))
    return entries


def _service_section() -> dict[str, str]:
    return dict(_service_entries())


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed here")
def test_unit_passes_systemd_analyze_verify_without_warnings(tmp_path):
    # verify also checks that ExecStart's program exists, so point it at this venv's openrld.
    openrld = Path(sys.executable).parent / "openrld"
    assert openrld.exists(), "install the package (pip install -e .) so the openrld script exists"
    unit = tmp_path / "openrld.service"
    unit.write_text(UNIT.read_text().replace(INSTALLED_OPENRLD, str(openrld)))
    result = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(unit)], capture_output=True, text=True, timeout=60
    )
    assert (result.returncode, result.stderr) == (0, "")


def test_unit_serves_from_its_state_directory_and_restarts_on_failure():
    service = _service_section()
    assert service["ExecStart"] == f"{INSTALLED_OPENRLD} serve --config /etc/openrld/openrld.toml"
    assert (service["StateDirectory"], service["Restart"]) == ("openrld", "on-failure")
    assert ("Environment", "OPENRLD_DATA_DIR=%S/openrld") in _service_entries()


def test_unit_is_hardened():
    service = _service_section()
    expected = {
        "DynamicUser": "yes", "NoNewPrivileges": "yes", "ProtectSystem": "strict", "ProtectHome": "yes",
        "PrivateTmp": "yes", "CapabilityBoundingSet": "", "RestrictSUIDSGID": "yes", "UMask": "0077",
    }
    assert {key: service.get(key) for key in expected} == expected
