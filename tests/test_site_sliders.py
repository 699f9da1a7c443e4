"""Sliders that move without a kernel: the HTML of `slider_frames` on a static page in headless Chromium (a file, no
server, no network), where moving a slider swaps the picture and the value shown; and the functions themselves:
one frame per setting, a bad grid refused before anything is drawn, a widget's frames over its background with the
widget put back afterwards."""
import base64
import io
import os

import numpy as np
import pytest
from matplotlib.figure import Figure

from teachloop.figures import FigureWidget, float_slider, palette_png, slider_frames
from chromium import need_chromium, watched_page


def wave(freq, phase):
    fig = Figure(figsize=(3, 1.5))
    ax = fig.subplots()
    x = np.linspace(0, 2 * np.pi, 100)
    ax.plot(x, np.sin(freq * x + phase))
    ax.set(ylim=(-1.1, 1.1), title=f'freq {freq}, phase {phase:.2f}')
    return fig


def captioned(freq): return wave(freq, 0.), f'<b>freq {freq}</b>'


GRID = {'freq': [1, 2, 3, 4], 'phase': {'0': 0., 'pi/2': np.pi / 2, 'pi': np.pi}}


class WaveWidget(FigureWidget):
    def __init__(self):
        fig = Figure(figsize=(3, 1.5))
        ax = fig.subplots()
        self.line = ax.plot([], [])[0]
        ax.set(xlim=(0, 2 * np.pi), ylim=(-1.1, 1.1))
        self.updates = 0
        super().__init__(fig, dict(freq=float_slider('freq', 2., 0.5, 4.), phase=float_slider('phase', 0., 0., 3.2)),
                         [self.line])

    def update(self, freq, phase):
        self.updates += 1
        x = np.linspace(0, 2 * np.pi, 100)
        self.line.set_data(x, np.sin(freq * x + phase))
        if freq > 3.5: self.line.axes.set_ylim(-2, 2)  # a frame whose limits change is drawn whole
        else: self.line.axes.set_ylim(-1.1, 1.1)


def test_one_frame_per_setting_each_a_small_png():
    frames = slider_frames(wave, GRID, start={'freq': 3, 'phase': 'pi'})
    assert len(frames) == len(frames.frames) == 4 * 3 and len(set(frames.frames)) == 12
    assert all(frame[:8] == b'\x89PNG\r\n\x1a\n' and len(frame) < 10_000 for frame in frames.frames)
    assert frames.index(freq='3', phase='pi') == 2 * 3 + 2 and frames.first == {'freq': '3', 'phase': 'pi'}
    html = frames.html()
    assert html.count('type="range"') == 2 and html.count('data:image/png;base64,') == 12
    assert f'<img class="tl-frames-picture" src="data:image/png;base64,{base64.b64encode(frames.frames[8]).decode()}"' in html


def test_a_frame_is_drawn_for_the_values_and_the_slider_shows_the_labels():
    seen = []
    def draw(freq, phase):
        seen.append((freq, phase))
        return wave(freq, phase)
    frames = slider_frames(draw, GRID)
    assert seen == [(f, p) for f in [1, 2, 3, 4] for p in (0., np.pi / 2, np.pi)]
    assert frames.sliders['phase'] == GRID['phase'] and list(frames.sliders['freq']) == ['1', '2', '3', '4']
    assert frames.frames[5] == palette_png(wave(2, np.pi))


@pytest.mark.parametrize('grid, start, message', [
    ({}, None, 'one or two sliders'),
    ({'a': [1], 'b': [2], 'c': [3]}, None, 'one or two sliders'),
    ([('beta', [0.5])], None, 'one or two sliders'),
    ({'beta': []}, None, "slider 'beta' has no values"),
    ({'beta': 0.9}, None, "give its values as a list"),
    ({'beta': 'fast'}, None, "give its values as a list"),
    ({'beta': [0.9, 0.9001]}, None, "offers ['0.9'] more than once"),
    ({'lr': list(range(7)), 'beta': list(range(7))}, None, '7 x 7 = 49 frames, more than max_frames=40'),
    ({'beta': [0.5, 0.9]}, {'beta': 0.7}, "start beta=0.7 is not one of the slider's values ['0.5', '0.9']"),
    ({'beta': [0.5, 0.9]}, {'lr': 0.1}, "start names ['lr'], which the grid has no slider for"),
])
def test_a_bad_grid_is_refused_before_anything_is_drawn(grid, start, message):
    drawn = []
    with pytest.raises(ValueError) as refused:
        slider_frames(lambda **values: drawn.append(values), grid, start)
    assert message in str(refused.value) and not drawn


def test_captions_come_with_their_frames():
    frames = slider_frames(captioned, {'freq': [1, 2]})
    assert frames.captions == ['<b>freq 1</b>', '<b>freq 2</b>'] and 'class="tl-frames-caption"><b>freq 1</b>' in frames.html()


def test_a_widgets_frames_share_its_background_and_leave_it_as_it_was():
    from PIL import Image
    widget = WaveWidget()
    widget.set_values(phase=1.)
    frames = widget.frames({'freq': [1., 2., 4.]})
    assert frames.first == {'freq': '2'} and len(frames) == 3  # it starts at the control's value
    assert widget.values() == {'freq': 2., 'phase': 1.} and widget.fig.dpi == 72
    assert np.allclose(widget.line.get_ydata(), np.sin(2 * np.linspace(0, 2 * np.pi, 100) + 1))
    alpha = [np.asarray(Image.open(io.BytesIO(frame)).convert('RGBA'))[..., 3] for frame in frames.frames]
    assert alpha[0].mean() < 0.2 * 255 and alpha[2].min() == 255  # the line alone; freq 4 moved the limits: whole
    assert Image.open(io.BytesIO(frames.background)).size == alpha[0].shape[::-1] == (3 * 72, int(1.5 * 72))
    html = frames.html()
    assert html.count('<img') == 2 and html.count('data:image/png;base64,') == 4  # the background, and 3 frames


def test_a_widgets_grid_is_checked_before_a_frame_is_drawn():
    widget = WaveWidget()
    updates = widget.updates
    with pytest.raises(KeyError, match=r"no control named \['speed'\]"): widget.frames({'speed': [1., 2.]})
    with pytest.raises(ValueError, match='more than max_frames=4'): widget.frames({'freq': [1., 2., 3.], 'phase': [0., 1.]}, max_frames=4)
    assert widget.updates == updates and widget.fig.dpi == 72


@pytest.fixture(scope='module')
def chromium_page():
    "A headless Chromium page that records page errors, console errors and any request for something not on disk."
    need_chromium()
    pytest.importorskip('playwright.sync_api', reason="the playwright package is not installed")
    with watched_page(('file:', 'data:'), viewport=(900, 900), http_errors=False) as found: yield found


def shown(block):
    "What a block of frames shows: the image's source, its pixels, and the value next to each slider."
    image = block.locator('img.tl-frames-picture')
    return image.get_attribute('src'), image.screenshot(), block.locator('output').all_inner_texts()


@pytest.mark.browser
def test_moving_a_slider_on_a_static_page_changes_the_picture(chromium_page, tmp_path):
    page, problems = chromium_page
    two = slider_frames(wave, GRID, start={'freq': 2})
    one = slider_frames(captioned, {'freq': [1, 2, 3]})
    layered = WaveWidget().frames({'freq': [1., 2., 3.]})
    path = tmp_path / 'sliders.html'
    path.write_text(f'<!doctype html><html><head><meta charset="utf-8"><title>sliders</title></head>'
                    f'<body>{two.html()}<p>between</p>{one.html()}<p>and</p>{layered.html()}</body></html>')
    page.goto(path.as_uri(), wait_until='load')
    blocks = page.locator('.tl-frames')
    assert blocks.count() == 3
    src, pixels, values = shown(blocks.nth(0))
    assert values == ['2', '0'] and src.endswith(base64.b64encode(two.frames[two.index(freq='2', phase='0')]).decode())
    other = shown(blocks.nth(1))

    freq, phase = blocks.nth(0).locator('input[type=range]').all()
    freq.focus()
    page.keyboard.press('ArrowRight')  # freq 2 -> 3, as a reader moves a slider with the keyboard
    src_after, pixels_after, values_after = shown(blocks.nth(0))
    assert values_after == ['3', '0'] and src_after != src and pixels_after != pixels
    assert src_after.endswith(base64.b64encode(two.frames[two.index(freq='3', phase='0')]).decode())

    box = phase.bounding_box()
    page.mouse.click(box['x'] + box['width'] - 2, box['y'] + box['height'] / 2)  # phase to its right end
    assert shown(blocks.nth(0))[2] == ['3', 'pi']
    assert shown(blocks.nth(0))[0].endswith(base64.b64encode(two.frames[two.index(freq='3', phase='pi')]).decode())

    page.keyboard.press('Home')  # phase back to 0: the first frame, kept only in the <img>, comes back
    freq.focus()
    page.keyboard.press('ArrowLeft')
    assert shown(blocks.nth(0))[0] == src and shown(blocks.nth(0))[2] == ['2', '0']
    assert shown(blocks.nth(1)) == other  # the other block did not move

    blocks.nth(1).locator('input[type=range]').fill('2')
    assert shown(blocks.nth(1))[2] == ['3'] and shown(blocks.nth(1))[0] != other[0]
    assert blocks.nth(1).locator('.tl-frames-caption').inner_html() == '<b>freq 3</b>'

    picture = blocks.nth(2).locator('div:has(> img.tl-frames-picture)')  # the background with the frame over it
    before = picture.screenshot()
    blocks.nth(2).locator('input[type=range]').fill('0')
    assert blocks.nth(2).locator('output').inner_text() == '1' and picture.screenshot() != before
    assert blocks.nth(2).locator('img.tl-frames-picture').get_attribute('src').endswith(base64.b64encode(layered.frames[0]).decode())
    assert not problems, problems
