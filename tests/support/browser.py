"""Debian's chromium, driven headless through its chromedriver by Selenium (nothing downloaded: both come from the
`chromium` and `chromium-driver` packages; scripts/ensure-system-packages.sh installs them)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.service import Service

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
MISSING = (
    "the console's browser tests need Debian's chromium and chromium-driver "
    "(/usr/bin/chromium, /usr/bin/chromedriver): run `sudo apt-get install chromium chromium-driver` "
    "(`make test` does it when CI=true)"
)


def missing_browser() -> str | None:
    return None if CHROMIUM.exists() and CHROMEDRIVER.exists() else MISSING


@contextmanager
def headless_chromium() -> Iterator[webdriver.Chrome]:
    """A fresh browser profile each time: no cookies, cache or history from another run."""
    profile = tempfile.mkdtemp(prefix="statestore-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        "--disable-dev-shm-usage",
        "--window-size=1280,1000",
        f"--user-data-dir={profile}",
    ):
        options.add_argument(flag)
    # An explicit driver path: Selenium Manager, which would look for a driver online, is never asked.
    driver = webdriver.Chrome(options=options, service=Service(executable_path=str(CHROMEDRIVER)))
    try:
        driver.set_page_load_timeout(30)
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)
