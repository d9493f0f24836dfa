"""TLS contexts from the node config (openrld/tls.py), and the CLI's refusal of unusable TLS files."""

from __future__ import annotations

import ssl
import subprocess
import sys
from pathlib import Path

import pytest
import trustme

from openrld.config import ConfigError, NodeConfig
from openrld.tls import peer_context, server_context


@pytest.fixture(scope="module")
def node_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(certificate, key, CA) for 127.0.0.1, from a throwaway CA."""
    root = tmp_path_factory.mktemp("tls")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    cert.cert_chain_pems[0].write_to_path(str(root / "node.crt"))
    cert.private_key_pem.write_to_path(str(root / "node.key"))
    ca.cert_pem.write_to_path(str(root / "ca.pem"))
    return root / "node.crt", root / "node.key", root / "ca.pem"


def config(**tls: Path) -> NodeConfig:
    return NodeConfig(data_dir=Path("/tmp/unused"), **tls)


def test_without_tls_there_is_no_server_context_and_peers_use_the_default_verification() -> None:
    assert (server_context(config()), peer_context(config())) == (None, True)


def test_the_server_context_speaks_tls_1_2_or_newer(node_files) -> None:
    cert, key, _ = node_files
    context = server_context(config(tls_certfile=cert, tls_keyfile=key))
    assert context is not None and context.minimum_version is ssl.TLSVersion.TLSv1_2


def test_with_a_private_ca_peers_are_verified_by_chain_not_host_name(node_files) -> None:
    cert, key, ca = node_files
    context = peer_context(config(tls_certfile=cert, tls_keyfile=key, tls_ca_certs=ca))
    assert isinstance(context, ssl.SSLContext)
    assert (context.verify_mode, context.check_hostname) == (ssl.CERT_REQUIRED, False)


def test_with_the_system_cas_peers_must_match_their_host_name_too(node_files) -> None:
    cert, key, _ = node_files
    context = peer_context(config(tls_certfile=cert, tls_keyfile=key))
    assert isinstance(context, ssl.SSLContext)
    assert (context.verify_mode, context.check_hostname) == (ssl.CERT_REQUIRED, True)


def test_a_key_that_does_not_match_is_a_config_error(node_files, tmp_path: Path) -> None:
    cert, _, _ = node_files
    other = trustme.CA().issue_cert("127.0.0.1")
    other.private_key_pem.write_to_path(str(tmp_path / "other.key"))
    with pytest.raises(ConfigError, match=r"^tls_certfile/tls_keyfile: cannot load the certificate and key: "):
        server_context(config(tls_certfile=cert, tls_keyfile=tmp_path / "other.key"))


def test_openrld_serve_refuses_an_unusable_certificate_in_one_line_with_exit_status_2(tmp_path: Path) -> None:
    (tmp_path / "bad.crt").write_text("not a certificate")
    (tmp_path / "bad.key").write_text("not a key")
    (tmp_path / "openrld.toml").write_text(
        f'data_dir = "{tmp_path / "data"}"\ntls_certfile = "{tmp_path / "bad.crt"}"\ntls_keyfile = "{tmp_path / "bad.key"}"\n'
    )
    done = subprocess.run(
        [sys.executable, "-m", "openrld.cli", "serve", "--port", "0", "--config", str(tmp_path / "openrld.toml")],
        capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 2
    assert done.stderr.startswith("openrld: tls_certfile/tls_keyfile: cannot load the certificate and key: ")
    assert done.stderr.count("\n") == 1
