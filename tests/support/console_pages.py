"""Driving the admin console's pages in a browser (tests/integration/test_console.py): navigation that waits for the
next page, the elements the pages name by id, screenshots, and a page on another site aimed at the console."""

from __future__ import annotations

import http.server
import os
import threading
from pathlib import Path

from selenium.common.exceptions import WebDriverException
from selenium.webdriver import Chrome
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support.ui import WebDriverWait

from tests.support.admin_api import AdminApi
from tests.support.server import StatestoreServer

CONSOLE = "/admin/console"
SCREENSHOTS = os.environ.get("STATESTORE_CONSOLE_SCREENSHOTS")


def go(driver: Chrome, server: StatestoreServer, path: str) -> None:
    driver.get(server.url + CONSOLE + path)


def click_and_wait(driver: Chrome, element: WebElement) -> None:
    """Click something that loads a new page, and wait until the new page has replaced the old one and loaded.

    The old page is marked with a window property that no new page has; asking the browser while it swaps pages can
    fail with a transient driver error (chromium: "Node with given id does not belong to the document"), so those
    are retried until the deadline rather than taken as the answer."""
    driver.execute_script("window.__statestoreOldPage = true")
    element.click()

    def new_page_loaded(d: Chrome) -> bool:
        return bool(
            d.execute_script("return window.__statestoreOldPage === undefined && document.readyState === 'complete'")
        )

    WebDriverWait(driver, 20, ignored_exceptions=(WebDriverException,)).until(new_page_loaded)


def press(driver: Chrome, element_id: str) -> None:
    click_and_wait(driver, driver.find_element(By.ID, element_id))


def sign_in(driver: Chrome, server: StatestoreServer, token: str) -> None:
    go(driver, server, "/sign-in")
    driver.find_element(By.ID, "token").send_keys(token)
    press(driver, "sign-in")


def text_of(driver: Chrome, element_id: str) -> str:
    return driver.find_element(By.ID, element_id).text


def present(driver: Chrome, element_id: str) -> bool:
    return bool(driver.find_elements(By.ID, element_id))


def screenshot(driver: Chrome, name: str) -> None:
    if SCREENSHOTS:
        Path(SCREENSHOTS).mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(Path(SCREENSHOTS) / f"{name}.png"))


def audit_rows(driver: Chrome) -> list[dict[str, str]]:
    rows = []
    for row in driver.find_elements(By.CSS_SELECTOR, "#audit tr.entry"):
        cell = {name: row.find_element(By.CLASS_NAME, name).text for name in ("actor", "action", "target", "change")}
        rows.append(cell)
    return rows


def audit_changes(row: WebElement) -> list[tuple[str, str, str]]:
    """An audit row's changes as (field, old, new), as its Change cell lists them."""
    found = []
    for item in row.find_elements(By.CSS_SELECTOR, "li.changed"):
        fields = item.find_elements(By.CSS_SELECTOR, "code.changed-field")
        old, new = (item.find_element(By.CLASS_NAME, part).text for part in ("old", "new"))
        found.append((fields[0].text if fields else "", old, new))
    return found


def lines_of(driver: Chrome, element: WebElement) -> int:
    """How many lines the browser laid an element's text out on."""
    script = "const r = document.createRange(); r.selectNodeContents(arguments[0]); return r.getClientRects().length"
    return int(driver.execute_script(script, element))


def tenant_names(admin: AdminApi) -> list[str]:
    return [t["name"] for t in admin.ok("GET", "/tenants")["data"]]


class AttackerSite:
    """A page on another site (localhost, where the console is 127.0.0.1) holding a form aimed at the console."""

    def __init__(self, html: str) -> None:
        body = html.encode()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("content-type", "text/html; charset=utf-8")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                return None

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://localhost:{self.server.server_address[1]}/"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
