"""What the console's tests share: a daemon with a key file, a training datum, and headless Chromium."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from tinker import types

from tests.conftest import Daemon, write_api_keys, write_config

CHROMIUM = "/usr/bin/chromium"  # Debian's chromium and chromium-driver; `make install-test` installs both
CHROMEDRIVER = "/usr/bin/chromedriver"
WINDOW = (1400, 1200)


def keyed_daemon(root: Path, tiny_llama: Path, users_by_key: dict[str, str], extra: str = "") -> Daemon:
    """A started daemon serving tiny-llama with a key file of `users_by_key`."""
    keys = write_api_keys(root / "keys.toml", users_by_key)
    config = write_config(
        root / "openrld.toml", root / "data", {"tiny-llama": tiny_llama},
        f'api_keys_file = "{keys}"\nlongpoll_s = 3.0\n{extra}',
    )
    return Daemon(root / "data", config, root / "daemon.log").start()


def datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


def chromium():
    """A headless Chromium driven by selenium; skips the test where the browser is not installed."""
    if shutil.which(CHROMIUM) is None or shutil.which(CHROMEDRIVER) is None:
        pytest.skip("chromium and chromium-driver are not installed (make install-test installs them)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 f"--window-size={WINDOW[0]},{WINDOW[1]}", "--force-device-scale-factor=1"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
