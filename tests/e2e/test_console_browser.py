"""The console in a real browser: headless Chromium against real daemons, with the real SDK training.

One daemon with alice's and bob's keys serves the run tests; two clustered
daemons serve the cluster test. Each test drives the page as a person would
(log in, click through) and waits on what the page shows, with a deadline.
With CONSOLE_SCREENSHOTS=<dir> set, each page is saved there as a PNG
(`CONSOLE_SCREENSHOTS=docs/console` refreshes the README's pictures).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import pytest
import tinker
from tinker import types

from tests.conftest import Daemon, write_config
from tests.e2e.console_support import chromium, datum, keyed_daemon

ALICE, BOB = "tml-alice-browser", "tml-bob-browser"
HOSTILE = "<script>window.pwned = 1</script><img src=x onerror=\"window.pwned = 2\">"
WAIT_S = 30.0  # the page polls every 2 s; a deadline well past a few polls
SECRET = "test-cluster-secret"


def shoot(driver, name: str) -> None:
    folder = os.environ.get("CONSOLE_SCREENSHOTS")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(Path(folder) / f"{name}.png"))


def wait(driver, condition, what: str):
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(
        driver, WAIT_S, poll_frequency=0.1, ignored_exceptions=[StaleElementReferenceException]
    ).until(condition, message=f"no {what} within {WAIT_S} s")


def settled(read):
    """`read()`, again if the page re-rendered what it was reading: it polls every 2 s and redraws."""
    from selenium.common.exceptions import StaleElementReferenceException

    for _ in range(50):
        try:
            return read()
        except StaleElementReferenceException:
            time.sleep(0.05)
    return read()


def text(driver, selector: str) -> str:
    return settled(lambda: css(driver, selector)[0].text)


def css(driver, selector: str):
    from selenium.webdriver.common.by import By

    return driver.find_elements(By.CSS_SELECTOR, selector)


def log_in(driver, url: str, key: str) -> None:
    driver.get(url + "/console")
    driver.execute_script("sessionStorage.clear()")
    driver.get(url + "/console#/runs")
    wait(driver, lambda d: not css(d, "#login")[0].get_attribute("hidden"), "login form")
    css(driver, "#key")[0].send_keys(key)
    css(driver, "#login-button")[0].click()
    wait(driver, lambda d: css(d, "#runs-table, #no-runs"), "runs page")


def run_ids(driver) -> list[str]:
    return settled(lambda: [row.get_attribute("data-run-id") for row in css(driver, "#runs-table tbody tr")])


def open_run(driver, run_id: str) -> None:
    settled(lambda: css(driver, f'#runs-table tr[data-run-id="{run_id}"] a')[0].click())


def train_step(training) -> None:
    """One step on the same sequence: its loss falls step by step, as a curve should."""
    training.forward_backward([datum(list(range(5, 29)))], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()


@pytest.fixture(scope="module")
def browser():
    driver = chromium()
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path):
    node = keyed_daemon(tmp_path_factory.mktemp("console-browser"), tiny_llama, {ALICE: "alice", BOB: "bob"})
    yield node
    node.stop()


@pytest.fixture(scope="module")
def runs(daemon: Daemon):
    """alice's run (named with markup, trained a step, one checkpoint) and bob's; their training clients."""
    clients = {}
    for key, name in ((ALICE, HOSTILE), (BOB, "bob's run")):
        service = tinker.ServiceClient(base_url=daemon.url, api_key=key)
        training = service.create_lora_training_client(
            base_model="tiny-llama", rank=4, seed=0, user_metadata={"name": name}
        ).result()
        train_step(training)
        clients[key] = (service, training)
    alice = clients[ALICE][1]
    alice.save_state("step-1", ttl_seconds=86400).result()
    yield {key: training for key, (_, training) in clients.items()}
    for service, _ in clients.values():
        service.close("success").result()


def test_a_user_logs_in_and_sees_their_own_run_and_not_anothers(browser, daemon: Daemon, runs):
    log_in(browser, daemon.url, BOB)
    assert run_ids(browser) == [runs[BOB].model_id]
    log_in(browser, daemon.url, ALICE)
    assert run_ids(browser) == [runs[ALICE].model_id]
    assert text(browser, "#who") == "alice"
    shoot(browser, "runs")


def test_a_wrong_key_is_refused_at_the_login_form(browser, daemon: Daemon):
    browser.get(daemon.url + "/console")
    browser.execute_script("sessionStorage.clear()")
    browser.refresh()
    wait(browser, lambda d: not css(d, "#login")[0].get_attribute("hidden"), "login form")
    css(browser, "#key")[0].send_keys("tml-not-a-key")
    css(browser, "#login-button")[0].click()
    wait(browser, lambda d: css(d, "#login-error")[0].text == "The node refused this key.", "refusal")
    assert text(browser, "#view") == ""


def test_a_run_named_with_markup_renders_it_as_text(browser, daemon: Daemon, runs):
    log_in(browser, daemon.url, ALICE)
    assert text(browser, "#runs-table tbody tr td.meta") == f"name={HOSTILE}"
    assert len(css(browser, "#runs-table tbody tr")) == 1
    assert browser.execute_script("return window.pwned") is None
    assert browser.execute_script("return document.scripts.length") == 1  # console.js, and nothing injected
    assert browser.execute_script("return document.querySelectorAll('#view img').length") == 0


def test_the_loss_curve_grows_while_the_client_trains(browser, daemon: Daemon, runs):
    training = runs[ALICE]
    log_in(browser, daemon.url, ALICE)
    open_run(browser, training.model_id)
    loss = 'canvas[data-metric="loss:sum"]'
    wait(browser, lambda d: css(d, loss) and css(d, loss)[0].get_attribute("data-points") == "1", "first point")
    for step in range(1, 4):
        train_step(training)
        wait(
            browser, lambda d, n=str(step + 1): css(d, loss)[0].get_attribute("data-points") == n,
            f"point {step + 1} drawn",
        )
    assert text(browser, "#run-title") == training.model_id
    for _ in range(4, 24):  # a longer curve for the picture
        train_step(training)
    sampler = training.save_weights_and_get_sampling_client().result()
    sampler.sample(types.ModelInput.from_ints([7, 8, 9]), 4, types.SamplingParams(max_tokens=8, stop=[])).result()
    wait(browser, lambda d: css(d, loss)[0].get_attribute("data-points") == "24", "the whole curve")
    wait(browser, lambda d: css(d, "#chart-sampling")[0].get_attribute("data-points") != "0", "sampling throughput")
    shoot(browser, "curves")


def test_a_run_leads_to_its_checkpoints(browser, daemon: Daemon, runs):
    training = runs[ALICE]
    log_in(browser, daemon.url, ALICE)
    open_run(browser, training.model_id)
    wait(browser, lambda d: css(d, "#tab-checkpoints"), "run page")
    settled(lambda: css(browser, "#tab-checkpoints")[0].click())
    path = f"tinker://{training.model_id}/weights/step-1"
    wait(browser, lambda d: css(d, "#checkpoints-table tbody tr"), "checkpoints table")
    rows = settled(lambda: [(r.get_attribute("data-path"), r.text) for r in css(browser, "#checkpoints-table tbody tr")])
    assert [p for p, _ in rows] == [path]
    assert text(browser, "#checkpoints-table tbody tr code.path") == path
    assert "expires" in rows[0][1] and "private" in rows[0][1]
    shoot(browser, "checkpoints")


def test_the_device_page_shows_the_group_on_the_nodes_device(browser, daemon: Daemon, runs):
    log_in(browser, daemon.url, BOB)
    browser.get(daemon.url + "/console#/cluster")
    wait(browser, lambda d: css(d, "#devices-table tbody tr"), "devices table")
    assert settled(lambda: [r.get_attribute("data-device") for r in css(browser, "#devices-table tbody tr")]) == ["cpu"]
    workers = settled(lambda: sorted(r.get_attribute("data-worker") for r in css(browser, "#workers-table tbody tr")))
    assert workers == ["tiny-llama sampler", "tiny-llama trainer"]
    budget = httpx.get(daemon.url + "/openrl/v1/node", headers={"X-API-Key": BOB}, timeout=30).json()["host_memory"]
    facts = settled(lambda: dict(zip((e.text for e in css(browser, "#host-memory dt")),
                                     (e.text for e in css(browser, "#host-memory dd")))))
    assert facts["Budget"] == shown_bytes(budget["budget_bytes"])
    assert facts["Parked state"] == "0 B"  # on the CPU a park moves nothing
    shoot(browser, "devices")


def shown_bytes(n: int) -> str:
    """A byte count as the page's `bytes` writes it (1000-based units, one decimal)."""
    units, value, i = ["B", "kB", "MB", "GB", "TB"], float(n), 0
    while value >= 1000 and i < len(units) - 1:
        value, i = value / 1000, i + 1
    return (str(n) if i == 0 else f"{value:.1f}") + " " + units[i]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path):
    root = tmp_path_factory.mktemp("console-cluster")
    nodes: dict[str, Daemon] = {}
    for name in ("node-a", "node-b"):
        seeds = f'"{nodes["node-a"].url.removeprefix("http://")}"' if nodes else ""
        extra = (
            f'node_name = "{name}"\ncluster_secret = "{SECRET}"\ngossip_port = 0\ngossip_timing = "local"\n'
            f"join = [{seeds}]\nlongpoll_s = 3.0\n"
        )
        config = write_config(root / f"{name}.toml", root / name, {"tiny-llama": tiny_llama}, extra)
        nodes[name] = Daemon(root / name, config, root / f"{name}.log").start()
    yield nodes
    for node in nodes.values():
        node.stop()


def member_state(driver, name: str) -> str | None:
    def read() -> str | None:
        rows = css(driver, f'#members-table tr[data-node="{name}"]')
        return rows[0].get_attribute("data-state") if rows else None

    return settled(read)


def test_a_killed_node_goes_dead_on_the_cluster_page(browser, cluster: dict[str, Daemon]):
    browser.get(cluster["node-a"].url + "/console#/cluster")  # open mode on loopback: no key asked
    wait(browser, lambda d: member_state(d, "node-b") == "alive", "node-b alive")
    assert member_state(browser, "node-a") == "alive"
    cluster["node-b"].kill()
    wait(browser, lambda d: member_state(d, "node-b") == "dead", "node-b dead")
    assert text(browser, '#members-table tr[data-node="node-b"] td.state') == "dead"
    shoot(browser, "cluster")
