"""The headless Chromium the browser tests drive, and a page that records what goes wrong on it."""
import os
import shutil
from contextlib import contextmanager

import pytest

CHROMIUM = shutil.which('chromium') or '/usr/bin/chromium'
CHROMIUM_ARGS = ['--no-sandbox', '--disable-gpu', '--disable-background-networking', '--disable-component-update',
                 '--disable-sync', '--no-first-run', '--disable-quic']


def need_chromium():
    if not os.path.exists(CHROMIUM): pytest.skip("chromium is not installed (`make browser-deps` installs it as root)")


@contextmanager
def watched_page(allowed, viewport=(1300, 1000), http_errors=True):
    """`(page, problems)`: a Chromium page whose console errors, page errors and failed requests are listed in
    `problems`, and whose requests for a URL not starting with one of `allowed` are refused and listed too."""
    from playwright.sync_api import sync_playwright
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        context = browser.new_context(viewport={'width': viewport[0], 'height': viewport[1]})
        problems = []
        def outside(route):
            problems.append(f"request leaving the machine: {route.request.url}")
            route.abort()
        context.route(lambda url: not url.startswith(allowed), outside)
        page = context.new_page()
        page.on('console', lambda msg: msg.type == 'error' and problems.append(f"console: {msg.text}"))
        page.on('pageerror', lambda error: problems.append(f"page error: {error}"))
        if http_errors:
            page.on('requestfailed', lambda request: problems.append(f"failed: {request.url} {request.failure}"))
            page.on('response', lambda response: response.status >= 400
                    and problems.append(f"HTTP {response.status}: {response.url}"))
        try: yield page, problems
        finally: browser.close()
