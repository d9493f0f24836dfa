"""The daemon's membership wiring: config options, seeds, the payload built from group statistics."""

from __future__ import annotations

import pytest

from openrld.actors.device_pool import DeviceUse
from openrld.actors.groups import GroupStatistics
from openrld.actors.jobs import HomeJob
from openrld.actors.sampler import SamplerStatistics
from openrld.actors.trainer import JobQueueStats, TrainerStatistics
from openrld.cluster.membership.messages import DeviceSlot, GroupLoad, JobNote, NodePayload
from openrld.cluster.membership.service import advertised_host, node_payload, seed_urls
from openrld.cluster.membership.transport import UdpTransport
from openrld.config import ConfigError, load_config

ENV = {"HOME": "/home/alice"}


def test_join_from_the_environment_is_comma_separated() -> None:
    env = {**ENV, "OPENRLD_CLUSTER_SECRET": "a-secret-of-16-plus", "OPENRLD_JOIN": "10.0.0.1:8000, openrld.svc ,"}
    assert load_config(None, {}, env).join == ("10.0.0.1:8000", "openrld.svc")


def test_join_without_a_cluster_secret_is_refused_naming_both() -> None:
    with pytest.raises(ConfigError, match="join: joining a cluster needs cluster_secret"):
        load_config(None, {"join": ("10.0.0.1:8000",)}, ENV)


def test_node_name_with_a_slash_is_refused() -> None:
    with pytest.raises(ConfigError, match="node_name"):
        load_config(None, {"node_name": "a/b"}, ENV)


async def test_seed_without_a_port_takes_the_node_port_and_names_resolve() -> None:
    assert await seed_urls(["127.0.0.1:9001", "127.0.0.1"], default_port=8000) == [
        "http://127.0.0.1:9001",
        "http://127.0.0.1:8000",
    ]


async def test_unresolvable_seed_is_skipped() -> None:
    assert await seed_urls(["no-such-host.invalid:8000"], default_port=8000) == []


def test_advertised_host_is_the_bind_host_unless_it_is_a_wildcard() -> None:
    assert advertised_host("127.0.0.1", "") == "127.0.0.1"
    assert advertised_host("0.0.0.0", "10.1.2.3") == "10.1.2.3"
    assert advertised_host("0.0.0.0", "") != "0.0.0.0"


def test_payload_counts_adapters_queues_and_jobs_per_group() -> None:
    sampler = SamplerStatistics(
        queue_depth=4, waiting=3, running=1, replicas=1, loaded_versions=0, host_versions=0,
        samples_done=0, samples_failed=0, samples_cancelled=0, samples_refused=0, busy=True,
    )
    trainer = TrainerStatistics(
        jobs=[JobQueueStats("m-2", 5, 2), JobQueueStats("m-1", 1, 0)], ops_done=0, ops_failed=0, ops_combined=0, busy=True
    )
    payload = node_payload("http://n:8000", [DeviceSlot("cpu", "cpu", 100, 40)], [GroupStatistics("tiny-llama", trainer, sampler)])
    # queue depth: 2 + 0 training ops waiting + 4 sample requests in the sampler
    assert payload == NodePayload(
        peer_url="http://n:8000",
        devices=(DeviceSlot("cpu", "cpu", 100, 40),),
        groups=(GroupLoad("tiny-llama", 2, 6),),
        jobs=("m-1", "m-2"),
    )


def test_payload_counts_groups_per_device_and_notes_each_home_job() -> None:
    devices = [DeviceSlot("cpu:0", "cpu", 100, 40), DeviceSlot("cpu:1", "cpu", 100, 40)]
    use = [DeviceUse("cpu:0", ["m-1"], True), DeviceUse("cpu:1", [], False)]
    home = [HomeJob("m-1", "alice", "tiny-llama", "lora", True, "tinker://m-1/weights/s1")]
    payload = node_payload("http://n:8000", devices, [], use, home)
    assert (payload.devices, payload.jobs, payload.job_notes) == (
        (DeviceSlot("cpu:0", "cpu", 100, 40, 1, True), DeviceSlot("cpu:1", "cpu", 100, 40, 0, False)),
        ("m-1",),
        {"m-1": JobNote("alice", "tiny-llama", "lora", True, "tinker://m-1/weights/s1")},
    )


async def test_a_datagram_the_kernel_refuses_is_lost_not_fatal() -> None:
    transport = await UdpTransport.open("127.0.0.1", 0, "127.0.0.1")
    try:
        # Broadcast without SO_BROADCAST: sendto fails with EACCES, as behind a prohibit route.
        await transport.send("255.255.255.255:7946", b"x")
    finally:
        await transport.aclose()
