"""Training speed of several checkouts of pstrain, alternated: which code trains faster?

    python benchmarks/compare.py NAME=DIR[:SCRIPT] NAME=DIR[:SCRIPT] ... \
        [--batch-size 128] [--epochs 4] [--servers 1] [--rounds 8] [--json PATH]

Each variant is a checkout (a `git worktree add DIR REV`, with the compiled `ps/*.so` copied
in) and a training script in it (default `examples/movielens.py`; pass a variant of the
loop as SCRIPT). Every round runs each variant once as a user does, `pstrain up --servers S
--workers 1 --mode async --no-view SCRIPT -- --batch-size B --epochs E` with the checkout on
PYTHONPATH, in order on even rounds and reversed on odd ones, so that drift in the
machine's load falls on every variant alike. Prints each run and the medians of worker 0's
samples/s (and its test AUC), and saves them as JSON. Run it alone: on a shared machine a
second job measures the load, not the code.

Each variant is also compared round by round with the first, whose run in the same round is
the nearest in time: the median of those paired ratios, a 90% bootstrap interval of it, and
in how many rounds the variant was faster. An interval that holds 1.0 means the rounds
cannot tell the two apart; on a noisy machine, run more rounds.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import statistics
from pathlib import Path

from saved import save
from training import MODES, run_up


def variant(text: str) -> tuple[str, Path, str]:
    """NAME=DIR[:SCRIPT] as (name, checkout, script); ArgumentTypeError names a bad one."""
    name, sep, rest = text.partition("=")
    where, _, script = rest.partition(":")
    checkout = Path(where).resolve()
    script = script or "examples/movielens.py"
    if not sep or not name or not where:
        raise argparse.ArgumentTypeError(f"a variant is NAME=DIR[:SCRIPT], got {text!r}")
    if not (checkout / "worker").is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: {checkout} is not a pstrain checkout")
    if not (checkout / script).is_file():
        raise argparse.ArgumentTypeError(f"{text!r}: {checkout / script} does not exist")
    return name, checkout, script


def paired(first: list[float], other: list[float], resamples: int = 2000
           ) -> dict[str, float]:
    """`other` against `first`, round by round: the median of the per-round ratios, a 90%
    bootstrap interval of that median (a fixed seed: the same runs give the same interval),
    and the rounds in which `other` was faster."""
    ratios = [b / a for a, b in zip(first, other, strict=True)]
    draw = random.Random(0)
    medians = sorted(statistics.median(draw.choices(ratios, k=len(ratios)))
                     for _ in range(resamples))
    return {"median": statistics.median(ratios), "low": medians[int(0.05 * resamples)],
            "high": medians[int(0.95 * resamples) - 1],
            "faster": sum(r > 1 for r in ratios), "rounds": len(ratios)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("variants", nargs="+", type=variant, metavar="NAME=DIR[:SCRIPT]")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--servers", type=int, default=1)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--json", help="write the figures here (default: a new file under "
                                  "benchmarks/results/)")
    a = p.parse_args()
    names = [name for name, _, _ in a.variants]
    if len(set(names)) != len(names):
        p.error(f"variant names must differ, got {names}")
    rates: dict[str, list[float]] = {name: [] for name in names}
    aucs: dict[str, list[float]] = {name: [] for name in names}
    for r in range(a.rounds):
        for name, checkout, script in a.variants if r % 2 == 0 else a.variants[::-1]:
            result = run_up(a.servers, 1, MODES["async"],
                            ["--batch-size", str(a.batch_size), "--epochs", str(a.epochs)],
                            script=str(checkout / script), repo=checkout)
            rates[name].append(float(result["samples_per_s"]))
            aucs[name].append(float(result["test_auc"]))
            print(f"round {r} {name}: {result['samples_per_s']:.0f} samples/s, test AUC "
                  f"{result['test_auc']:.5f}", flush=True)
    medians = {name: statistics.median(v) for name, v in rates.items()}
    first = names[0]
    pairs = {name: paired(rates[first], rates[name]) for name in names[1:]}
    for name in names:
        line = (f"{name:<16}{medians[name]:>10.0f} samples/s (median of {a.rounds}), "
                f"{medians[name] / medians[first]:.3f}x {first}")
        if name in pairs:
            pair = pairs[name]
            line += (f"; round by round {pair['median']:.3f}x (90% interval "
                     f"{pair['low']:.3f}-{pair['high']:.3f}), faster in {pair['faster']} of "
                     f"{pair['rounds']}")
        print(line)
    save({
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()}",
        "batch_size": a.batch_size, "epochs": a.epochs, "servers": a.servers,
        "rounds": a.rounds,
        "variants": {name: {"checkout": str(checkout), "script": script}
                     for name, checkout, script in a.variants},
        "samples_per_s": medians,
        "ratio_to_first": {name: medians[name] / medians[first] for name in names},
        "paired_to_first": pairs,
        "runs": rates, "test_auc": aucs,
    }, f"compare-{datetime.date.today().isoformat()}-b{a.batch_size}-s{a.servers}", a.json)


if __name__ == "__main__":
    main()
