"""TLS for the API and between nodes: two real daemons with certificates from a throwaway CA.

Node A is a front node (`accept_jobs = false`), so the job a client creates
through it lives on node B, and every call for it is relayed from A to B with
the caller's key: over HTTPS, verified against the cluster's CA. The client is
the real SDK, trusting the CA through SSL_CERT_FILE as a user's would.
"""

from __future__ import annotations

import json
import ssl
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import tinker
import trustme
from tinker import types

from tests.conftest import Daemon, write_config
from tests.e2e.test_cluster_jobs import HERE_ONLY, KEY, cluster_config, wait_for


@pytest.fixture(scope="module")
def ca_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[trustme.CA, Path]:
    ca = trustme.CA()
    path = tmp_path_factory.mktemp("ca") / "ca.pem"
    ca.cert_pem.write_to_path(str(path))
    return ca, path


def tls_config(directory: Path, ca: trustme.CA, ca_path: Path) -> str:
    """A node certificate for 127.0.0.1 and the config lines that use it."""
    cert = ca.issue_cert("127.0.0.1", "localhost")
    cert_path, key_path = directory / "node.crt", directory / "node.key"
    cert.cert_chain_pems[0].write_to_path(str(cert_path))
    cert.private_key_pem.write_to_path(str(key_path))
    key_path.chmod(0o600)
    return f'tls_certfile = "{cert_path}"\ntls_keyfile = "{key_path}"\ntls_ca_certs = "{ca_path}"\n'


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path, ca_file):
    ca, ca_path = ca_file
    root = tmp_path_factory.mktemp("tls-cluster")
    daemons: dict[str, Daemon] = {}
    for name, extra in (("node-a", "accept_jobs = false\n"), ("node-b", "")):
        seeds = [next(iter(daemons.values())).url.removeprefix("https://")] if daemons else []
        certs = root / f"{name}-tls"
        certs.mkdir()
        extra += tls_config(certs, ca, ca_path)
        config = write_config(root / f"{name}.toml", root / name, {"tiny-llama": tiny_llama}, cluster_config(name, seeds, extra))
        daemons[name] = Daemon(root / name, config, root / f"{name}.log").start()
    try:
        with httpx.Client(verify=ssl.create_default_context(cafile=ca_path)) as client:
            wait_for(lambda: _sees(client, daemons["node-a"].url, "node-b"), timeout_s=15.0)
        yield daemons
    finally:
        for daemon in daemons.values():
            daemon.stop()


def _sees(client: httpx.Client, url: str, name: str) -> bool:
    members = client.get(f"{url}/openrl/v1/cluster", headers={"X-API-Key": KEY}).json()["members"]
    return any(m["name"] == name and m["state"] == "alive" and m["devices"] for m in members)


def test_a_tls_node_prints_an_https_url(cluster: dict[str, Daemon]) -> None:
    assert [d.url.split(":")[0] for d in cluster.values()] == ["https", "https"]


def test_a_plain_http_request_to_a_tls_node_gets_no_answer(cluster: dict[str, Daemon]) -> None:
    plain = cluster["node-b"].url.replace("https://", "http://")
    with pytest.raises(httpx.HTTPError):
        httpx.get(plain + "/api/v1/healthz", timeout=5)


def test_peers_advertise_https_urls(cluster: dict[str, Daemon], ca_file) -> None:
    members = httpx.get(
        cluster["node-a"].url + "/openrl/v1/cluster", headers={"X-API-Key": KEY}, verify=ssl.create_default_context(cafile=ca_file[1])
    ).json()["members"]
    assert sorted((m["name"], m["peer_url"].split("://")[0]) for m in members) == [("node-a", "https"), ("node-b", "https")]


def test_the_sdk_trains_and_samples_through_a_tls_front_node_with_the_job_on_its_peer(
    cluster: dict[str, Daemon], ca_file, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SSL_CERT_FILE", str(ca_file[1]))
    service = tinker.ServiceClient(base_url=cluster["node-a"].url, api_key=KEY)
    try:
        training = service.create_lora_training_client(base_model="tiny-llama", rank=4, seed=0).result()
        datum = types.Datum(
            model_input=types.ModelInput.from_ints([1, 2, 3, 4]), loss_fn_inputs={"target_tokens": [2, 3, 4, 5]}
        )
        loss = training.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"]
        training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        sampler = training.save_weights_and_get_sampling_client().result()
        sampled = sampler.sample(
            types.ModelInput.from_ints([1, 2, 3]), num_samples=2,
            sampling_params=types.SamplingParams(max_tokens=4, temperature=1.0, seed=1),
        ).result()
        assert loss > 0
        assert [len(s.tokens) for s in sampled.sequences] == [4, 4]
        with httpx.Client(verify=ssl.create_default_context(cafile=ca_file[1])) as client:
            homes = [
                name for name, d in cluster.items()
                if client.get(f"{d.url}/openrl/v1/models/{training.model_id}/status", headers=HERE_ONLY).status_code == 200
            ]
        assert homes == ["node-b"]
    finally:
        service.close("success").result()


def test_the_doctor_reports_https_and_peers_over_https(cluster: dict[str, Daemon], ca_file) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "openrld.doctor", "--url", cluster["node-a"].url, "--api-key", KEY,
         "--ca-cert", str(ca_file[1]), "--no-smoke", "--json"],
        capture_output=True, text=True, timeout=60,
    )
    checks = {c["name"]: c for c in json.loads(done.stdout)["checks"]}
    assert (checks["tls"]["status"], checks["tls"]["summary"]) == ("ok", "HTTPS, certificate verified")
    assert checks["cluster"]["status"] == "ok"
    assert checks["cluster"]["summary"].startswith("2 members (peers over HTTPS): ")
    assert done.returncode == 0
