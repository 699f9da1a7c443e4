"""The fair race of notebook 07b from the command line: each optimizer's learning-rate sweep on seed 0, its best rate
on every seed, the same number of steps for all; prints the Markdown table and writes it to `--out`.

    python bench/optimizer_race.py [--epochs 8] [--seeds 0 1 2] [--out bench/optimizer_race.md] [--threads 1]
"""
import argparse
from pathlib import Path

import torch

from teachloop.data import digits_dls
from teachloop.lessons.race import race_table, racers, run_race


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--epochs', type=int, default=8)
    parser.add_argument('--seeds', type=int, nargs='+', default=[0, 1, 2])
    parser.add_argument('--out', type=Path, default=Path(__file__).with_name('optimizer_race.md'))
    parser.add_argument('--threads', type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    n_steps = args.epochs * len(digits_dls(bs=64).train)
    results = run_race(racers(n_steps), tuple(args.seeds), args.epochs)
    table = (f"Digits perceptron, {args.epochs} epochs ({n_steps} steps), seeds {args.seeds}, torch {torch.__version__}, "
             f"{args.threads} thread(s)\n\n{race_table(results)}\n")
    args.out.write_text(table)
    print(table)


if __name__ == '__main__':
    main()
