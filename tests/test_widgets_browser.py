"""The direction-decay and optimizer-builder widgets in a real browser (Jupyter Notebook 7, headless Chromium; the
dashboard's test drives JupyterLab): moving a slider or ticking callbacks redraws the picture, and the builder's
message follows the list. Saves screenshots to artifacts/. Each wait is for the page to change, with a time limit only against a hang."""
from pathlib import Path

import pytest

from test_dashboard_browser import (ARTIFACTS, browser_page, drag_slider_left, jupyter,  # noqa: F401 (the fixture)
                                    open_notebook, run_cell, wait_for)

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(1800)]
NOTEBOOK = Path(__file__).resolve().parent / 'browser' / 'widgets.ipynb'


def image_source(page, selector):
    return page.locator(f'{selector} img').first.get_attribute('src')


@pytest.mark.parametrize('jupyter', ['notebook7'], indirect=True)
def test_widgets_redraw_in_the_browser(jupyter):
    prefix = jupyter['front_end'].artifact_prefix.replace('dashboard', 'widgets')
    with browser_page(jupyter, prefix, width=1400) as page:
        open_notebook(page, jupyter['url'], jupyter['front_end'])
        run_cell(page, 0)
        first = wait_for(lambda: page.locator('.tl-decay img').count() and image_source(page, '.tl-decay'),
                         'the decay widget', page=page)
        readout = page.locator('.tl-beta .widget-readout').inner_text()
        drag_slider_left(page, '.tl-beta', 60)
        wait_for(lambda: page.locator('.tl-beta .widget-readout').inner_text() != readout, 'beta to move')
        wait_for(lambda: image_source(page, '.tl-decay') != first, 'the decay picture to change')
        page.locator('.tl-decay').screenshot(path=str(ARTIFACTS / f'{prefix}_decay.png'))

        message, callbacks = page.locator('.tl-builder .widget-html-content'), page.locator('.tl-builder select[multiple]')
        wait_for(lambda: 'AdamW' in message.inner_text(), 'the builder to name AdamW')
        before = image_source(page, '.tl-builder')
        callbacks.select_option(['average the gradient', 'average the squared gradient',
                                 'step: over the gradient RMS (RMSProp)'])
        wait_for(lambda: 'RMSProp with momentum' in message.inner_text(), 'the builder to name RMSProp')
        wait_for(lambda: image_source(page, '.tl-builder') != before, 'the builder picture to change')
        callbacks.select_option(['step: debiased averages (Adam)'])
        wait_for(lambda: 'not an optimizer yet' in message.inner_text(), 'the builder to refuse the list')
        page.locator('.tl-builder').screenshot(path=str(ARTIFACTS / f'{prefix}_builder.png'))
