"""Slider-to-redraw latency of the momentum notebook's widgets.

Each widget's sliders are set from code, as a browser's slider move would set them; the observer redraws at once,
so the time of the assignment is the time from the move to the new PNG in the `ipywidgets.Image` (update of the
artists, drawing, PNG encoding). Three ways of producing the picture are timed side by side in one run:
- `image, blit`: what the widgets do: static parts drawn once as a background, changed artists painted over it;
- `image, full draw`: the same with the background thrown away before every redraw;
- `output, savefig`: what showing the figure in an `ipywidgets.Output` with `display(fig)` costs for the picture
  (the inline backend's `savefig(format='png', bbox_inches='tight')`), without the frontend's clear and re-display.
Run: `.venv/bin/python bench/widget_latency.py`
"""
import io
import os
import statistics
import time

import torch

from teachloop.lessons.momentum import DirectionDecayWidget, EWMAWidget, GradientStreamWidget, TrajectoryWidget
from teachloop.lessons.optimizer_builder import OptimizerBuilder

torch.set_num_threads(1)


def slider_moves(widget, name, values):
    "Milliseconds per move of slider `name` through `values`."
    times = []
    for value in values:
        start = time.perf_counter()
        widget.controls[name].value = value
        times.append((time.perf_counter() - start) * 1e3)
    return times


def savefig_moves(widget, name, values):
    "Milliseconds per move when the picture is made by `savefig` with a tight bounding box instead."
    times = []
    with widget.holding():
        for value in values:
            start = time.perf_counter()
            widget.controls[name].value = value
            widget.update(**widget.values())
            buffer = io.BytesIO()
            for artist in widget.dynamic: artist.set_animated(False)
            widget.fig.savefig(buffer, format='png', bbox_inches='tight')
            for artist in widget.dynamic: artist.set_animated(True)
            times.append((time.perf_counter() - start) * 1e3)
    return times


def full_draw_moves(widget, name, values):
    "Milliseconds per move when the whole figure is drawn every time."
    original = widget.draw
    def draw_all():
        widget.forget_background()
        original()
    widget.draw = draw_all
    try: return slider_moves(widget, name, values)
    finally: widget.draw = original


def summary(times):
    times = sorted(times)
    return (f"min {times[0]:5.1f}  median {statistics.median(times):5.1f}  p90 {times[int(0.9 * (len(times) - 1))]:5.1f}  "
            f"max {times[-1]:6.1f} ms")


def main():
    grads = torch.randn(180, generator=torch.Generator().manual_seed(0)) * 0.01
    betas = [0.5 + 0.45 * i / 19 for i in range(20)]
    cases = [
        ('EWMAWidget, beta', lambda: EWMAWidget(), 'beta', betas),
        ('EWMAWidget, noise', lambda: EWMAWidget(), 'noise', [0.02 * i for i in range(1, 21)]),
        ('TrajectoryWidget (100 steps), beta', lambda: TrajectoryWidget(steps=100), 'beta', betas),
        ('TrajectoryWidget (100 steps), lr', lambda: TrajectoryWidget(steps=100), 'lr', [0.005 + 0.003 * i for i in range(20)]),
        ('TrajectoryWidget (200 steps), beta', lambda: TrajectoryWidget(steps=200), 'beta', betas),
        ('TrajectoryWidget (rosenbrock, 200), beta', lambda: TrajectoryWidget('rosenbrock', steps=200), 'beta', betas),
        ('GradientStreamWidget (180 steps), beta', lambda: GradientStreamWidget(grads), 'beta', betas),
        ('DirectionDecayWidget (60 steps), beta', lambda: DirectionDecayWidget(), 'beta', betas),
        ('OptimizerBuilder (AdamW), lr', lambda: OptimizerBuilder(), 'lr', [0.005 * 1.15 ** i for i in range(20)]),
        ('DirectionDecayWidget (200 steps), lr', lambda: DirectionDecayWidget(steps=200), 'lr', [0.05 * 1.2 ** i for i in range(20)]),
    ]
    print(f"torch threads 1, load average before the run {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores "
          "(other work on the machine slows every column alike)")
    print(f"{'widget, slider':42s} {'image, blit (used)':44s} {'image, full draw':44s} output, savefig")
    for label, make, name, values in cases:
        results = [method(make(), name, values) for method in (slider_moves, full_draw_moves, savefig_moves)]
        blit = statistics.median(results[0])
        ratios = '  '.join(f"{statistics.median(r) / blit:4.1f}x" for r in results[1:])
        print(f"{label:42s} " + ' | '.join(summary(r) for r in results) + f"   (vs blit: {ratios})")


if __name__ == '__main__':
    main()
