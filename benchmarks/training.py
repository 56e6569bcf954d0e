"""Training benchmark: does distributed training learn as well, and how fast, and at scale?

    python benchmarks/training.py [--quick] [--only auc,speed,cpu,growth,tls] [--json PATH]

Runs the examples as a user does (`--local`, and under `pstrain up`), in one run (or the
sections --only names):
- AUC: MovieLens-100k test AUC over 3 seeds for single-process PyTorch (`local`) and for
  2 workers on 1 server in sync, ssp (s=2) and async. Goals: sync >= local - 0.005; ssp
  and async >= local - 0.01.
- speed: samples/s of 1 server + 1 worker (async, overlapped) against single-process
  PyTorch on the same model, at batch 128 and 1024, over --speed-epochs epochs (the rate
  a longer job sees; one epoch at batch 1024 is 79 steps, mostly start-up), with the
  example's default prefetch depth ("auto": 2 under async for batches under 512, else 1)
  and with the other of 1 and 2; each the ratio of the medians of --repeats alternated
  runs. For reference also over 1 epoch.
  Goals: >= 0.8x and >= 1.0x.
- cpu: at batch 1024, CPU seconds per training sample of every process of the 1 + 1 job
  (Redis, scheduler, server, worker) against single-process PyTorch (`cpu_ratio_b1024`, goal
  <= 2.0), and of the model with its eight features declared as eight tables of one
  PSEmbeddingCollection against the hand-fused model (`table_count_cpu_ratio`, goal <= 1.15);
  for reference, seven separate PSEmbedding modules against fused
  (`separate_modules_cpu_ratio`). See bench_cpu for how start-up is kept out.
- growth: examples/synthetic_ctr.py on 2 servers until the tables hold --growth-rows rows:
  samples/s at the end against the start (goal >= 0.8x), and server memory per row against
  the raw bytes of its value and Adagrad state.
- tls: at batch 1024, samples/s of the 1 + 1 async job (`pstrain up`, --speed-epochs epochs)
  with mutual TLS and the job secret (its default) against `--no-tls`, alternated over
  --repeats runs: `tls_step_ratio_b1024` = median on / median off. On one host the worker's
  transport is then auto, which picks shm with its request lane, so TLS carries only the
  control calls; `tls_step_ratio_b1024_grpc` is the same with `--transport grpc`, where TLS
  carries every byte. Each records the transport the worker's log says it uses.
Prints a table; writes JSON and a PNG (test AUC after each epoch against wall time, per
mode and run) under benchmarks/results/ (and --json PATH).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from procs import Procs  # noqa: E402
from saved import save  # noqa: E402

PY = sys.executable
MOVIELENS = str(REPO / "examples" / "movielens.py")
SYNTHETIC = str(REPO / "examples" / "synthetic_ctr.py")
MODES = {"sync": ["--mode", "sync"], "ssp": ["--mode", "ssp", "--staleness", "2"],
         "async": ["--mode", "async"]}


def children_cpu_s() -> float:
    """CPU seconds (user + system) of every child process waited for so far, with theirs:
    `pstrain up` waits for its Redis, scheduler, servers and workers."""
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def run(command: list[str], repo: Path = REPO) -> tuple[subprocess.CompletedProcess[str], float]:
    """Runs `command` to its end in checkout `repo` (its code first on the path); its
    output and the CPU seconds it and its children used."""
    before = children_cpu_s()
    env = None if repo == REPO else {**os.environ, "PYTHONPATH": str(repo)}
    done = subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True,
                          check=True, timeout=1800)
    return done, children_cpu_s() - before


def run_local(args: list[str]) -> dict[str, Any]:
    done, cpu_s = run([PY, MOVIELENS, "--local", *args])
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "cpu_s": cpu_s}


def run_up(servers: int, workers: int, mode: list[str], args: list[str],
           up_flags: tuple[str, ...] = (), script: str = MOVIELENS,
           repo: Path = REPO) -> dict[str, Any]:
    """`pstrain up ... SCRIPT` (with `up_flags` for `pstrain up` itself) from checkout
    `repo`; the result of worker 0, and the CPU seconds of the whole job (every process
    `pstrain up` started, Redis included)."""
    done, cpu_s = run([PY, "-m", "scheduler.cli", "up", "--servers", str(servers),
                       "--workers", str(workers), *mode, "--no-view", *up_flags, script,
                       "--", *args], repo)
    for line in done.stdout.splitlines():
        if line.startswith("worker 0: "):
            return {**json.loads(line.removeprefix("worker 0: ")), "cpu_s": cpu_s}
    raise RuntimeError(f"no result from worker 0:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")


def bench_auc(seeds: list[int], extra: list[str]) -> dict[str, list[dict[str, Any]]]:
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in ("local", *MODES)}
    for seed in seeds:
        args = ["--seed", str(seed), *extra]
        runs["local"].append(run_local(args))
        print(f"  seed {seed} local AUC {runs['local'][-1]['test_auc']:.4f}", flush=True)
        for mode, flags in MODES.items():
            runs[mode].append(run_up(1, 2, flags, args))
            print(f"  seed {seed} {mode} AUC {runs[mode][-1]['test_auc']:.4f}", flush=True)
    return runs


def bench_speed(batch: int, depth: str, repeats: int, epochs: int) -> dict[str, object]:
    """Local and 1+1 async runs, alternated `repeats` times: the ratio of their medians."""
    args = ["--batch-size", str(batch), "--epochs", str(epochs)]
    local: list[float] = []
    distributed: list[float] = []
    resolved: set[object] = set()
    for _ in range(repeats):
        local.append(run_local(args)["samples_per_s"])
        run = run_up(1, 1, MODES["async"], [*args, "--prefetch-depth", depth])
        distributed.append(run["samples_per_s"])
        resolved.add(run["prefetch_depth"])
    lm, dm = statistics.median(local), statistics.median(distributed)
    (used,) = resolved
    return {"local": lm, "distributed": dm, "ratio": dm / lm, "local_runs": local,
            "distributed_runs": distributed, "epochs": epochs, "prefetch_depth": depth,
            "depth_used": used}


def bench_cpu(batch: int, repeats: int, short: int, long: int) -> dict[str, Any]:
    """CPU seconds per training sample of the whole job, each process counted (`pstrain up`:
    Redis, scheduler, server, worker; 1 + 1, async), against single-process PyTorch, and of
    the MovieLens model with its features declared as tables of one collection, and as
    separate modules, against fused by hand.

    A run's CPU includes start-up and the last evaluation, so each setting runs `short` and
    `long` epochs and the difference is divided by the samples of the extra epochs (an epoch's
    evaluation stays in: the same forward on both sides). Medians of `repeats`, alternated.
    """
    args = ["--batch-size", str(batch)]
    settings: dict[str, Any] = {
        "local": lambda e: run_local([*args, "--epochs", str(e)]),
        "fused": lambda e: run_up(1, 1, MODES["async"], [*args, "--epochs", str(e)]),
        "separate": lambda e: run_up(1, 1, MODES["async"], [*args, "--epochs", str(e),
                                                           "--tables", "separate"]),
        "collection": lambda e: run_up(1, 1, MODES["async"], [*args, "--epochs", str(e),
                                                             "--tables", "collection"]),
    }
    per_sample: dict[str, list[float]] = {name: [] for name in settings}
    rates: dict[str, list[float]] = {name: [] for name in settings}
    for _ in range(repeats):
        for name, go in settings.items():
            a, b = go(short), go(long)
            samples = int(b["train_samples"]) * (long - short)
            per_sample[name].append((b["cpu_s"] - a["cpu_s"]) / samples)
            rates[name].append(float(b["samples_per_s"]))
    med = {name: statistics.median(v) for name, v in per_sample.items()}
    return {"cpu_us_per_sample": {k: v * 1e6 for k, v in med.items()},
            "cpu_us_per_sample_runs": {k: [x * 1e6 for x in v] for k, v in per_sample.items()},
            "samples_per_s": {k: statistics.median(v) for k, v in rates.items()},
            "cpu_ratio": med["fused"] / med["local"],
            "table_count_cpu_ratio": med["collection"] / med["fused"],
            "table_count_speed_ratio": (statistics.median(rates["collection"])
                                        / statistics.median(rates["fused"])),
            "separate_modules_cpu_ratio": med["separate"] / med["fused"],
            "batch": batch, "epochs": [short, long]}


# What worker 0's log, else server 0's, says of the transport between them.
_USES_TRANSPORT = (("worker0.log", re.compile(r"worker 0: shard 0 \(.*?\) uses transport (.+)$")),
                   ("server0.log", re.compile(r"shard 0: worker 0 uses transport (.+)$")))


def transport_used(log_dir: Path) -> str:
    """The transport worker 0 uses to shard 0 (and its request lane, where it has one), as
    the logs in `log_dir` of a `pstrain up` say; "" when they do not say."""
    for name, pattern in _USES_TRANSPORT:
        path = log_dir / name
        for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
            match = pattern.search(line)
            if match:
                return match.group(1)
    return ""


def bench_tls(batch: int, repeats: int, epochs: int, transport: str) -> dict[str, Any]:
    """1+1 async runs with mutual TLS and the job secret (pstrain up's default) and with
    --no-tls, alternated `repeats` times, the worker's transport `transport`: the ratio of
    their medians, and the transport each run's worker used."""
    args = ["--batch-size", str(batch), "--epochs", str(epochs)]
    rates: dict[str, list[float]] = {"on": [], "off": []}
    used: dict[str, set[str]] = {"on": set(), "off": set()}
    for _ in range(repeats):
        for side, flags in (("on", ()), ("off", ("--no-tls",))):
            with tempfile.TemporaryDirectory(prefix="pstrain-tls-") as logs:
                run = run_up(1, 1, MODES["async"], args,
                             ("--transport", transport, "--log-dir", logs, *flags))
                used[side].add(transport_used(Path(logs)))
            rates[side].append(run["samples_per_s"])
    on, off = statistics.median(rates["on"]), statistics.median(rates["off"])
    return {"on": on, "off": off, "ratio": on / off, "on_runs": rates["on"],
            "off_runs": rates["off"], "batch": batch, "epochs": epochs, "transport": transport,
            "transport_used": {side: sorted(u) for side, u in used.items()}}


SECTIONS = ("auc", "speed", "cpu", "growth", "tls")
_PROGRESS = re.compile(r"step (\d+): loss [\d.]+, (\d+) samples/s, (\d+) rows")


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def bench_growth(target_rows: int, batch: int, dim: int) -> dict[str, float]:
    """synthetic_ctr on 2 servers until the tables hold target_rows rows."""
    work = Path(tempfile.mkdtemp(prefix="pstrain-growth-"))
    procs = Procs(work)
    try:
        servers = procs.servers(2, ["--log-level", "WARNING"])
        start_rss = sum(rss(s.pid) for s in servers)
        env = {**os.environ, "PSTRAIN_SERVERS": ",".join(s.address for s in servers)}
        steps = 1_000_000  # stopped when the tables are big enough
        proc = subprocess.Popen([PY, SYNTHETIC, "--steps", str(steps), "--batch", str(batch),
                                 "--dim", str(dim), "--log-every", "25"], cwd=REPO, env=env,
                                stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
        points: list[tuple[int, float, int]] = []  # (samples, seconds, rows)
        assert proc.stderr is not None
        for line in proc.stderr:
            match = _PROGRESS.search(line)
            if not match:
                continue
            step, cum_rate, rows = (int(g) for g in match.groups())
            samples = step * batch
            points.append((samples, samples / max(cum_rate, 1), rows))
            if rows >= target_rows:
                break
        end_rss = sum(rss(s.pid) for s in servers)
        proc.kill()
        proc.wait()
    finally:
        procs.close()

    def rate(a: int, b: int) -> float:
        return (points[b][0] - points[a][0]) / (points[b][1] - points[a][1])

    # Skip the first interval (start-up), then compare the first and last tenths.
    tenth = max(1, len(points) // 10)
    start = rate(1, 1 + tenth)
    end = rate(len(points) - 1 - tenth, len(points) - 1)
    rows = points[-1][2]
    raw_row = dim * 4 * 2  # float32 value + Adagrad sum
    return {"rows": rows, "start_samples_per_s": start, "end_samples_per_s": end,
            "growth_ratio": end / start, "bytes_per_row": (end_rss - start_rss) / rows,
            "row_memory_ratio": (end_rss - start_rss) / rows / raw_row}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="1 seed, 2 epochs, 2 M rows")
    p.add_argument("--only", default=",".join(SECTIONS),
                   help=f"comma-separated sections to run, of {','.join(SECTIONS)} (default all)")
    p.add_argument("--growth-rows", type=int, default=0, help="default 20 M (quick: 2 M)")
    p.add_argument("--json", help="also write the figures to this path")
    p.add_argument("--repeats", type=int, default=3,
                   help="speed, cpu and tls runs per setting")
    p.add_argument("--speed-epochs", type=int, default=0, help="default 4 (quick: 2)")
    p.add_argument("--cpu-epochs", type=int, nargs=2, default=[1, 9], metavar=("SHORT", "LONG"),
                   help="cpu: the two run lengths whose difference is measured (default 1 9)")
    a = p.parse_args()
    only = set(a.only.split(","))
    if not only <= set(SECTIONS):
        p.error(f"--only: unknown section(s) {sorted(only - set(SECTIONS))}; "
                f"choose from {','.join(SECTIONS)}")
    speed_epochs = a.speed_epochs or (2 if a.quick else 4)
    seeds = [0] if a.quick else [0, 1, 2]
    extra = ["--epochs", "2"] if a.quick else []
    growth_rows = a.growth_rows or (2_000_000 if a.quick else 20_000_000)
    results: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()}",
        "quick": a.quick, "sections": sorted(only),
    }
    runs: dict[str, list[dict[str, Any]]] = {}
    if "auc" in only:
        print("AUC on MovieLens-100k ...", flush=True)
        runs = bench_auc(seeds, extra)
        results["seeds"] = seeds
        results["auc"] = {m: statistics.mean(r["test_auc"] for r in rs) for m, rs in runs.items()}
        results["auc_runs"] = {m: [r["test_auc"] for r in rs] for m, rs in runs.items()}
        results["wall_s"] = {m: [r["wall_s"] for r in rs] for m, rs in runs.items()}
    if "speed" in only:
        print("speed, 1 server + 1 worker against single-process ...", flush=True)
        speed: dict[str, dict[str, Any]] = {}
        for b in (128, 1024):
            # The example's default depth ("auto": 2 for small batches, else 1), the other.
            auto = speed[f"b{b}"] = bench_speed(b, "auto", a.repeats, speed_epochs)
            other = 3 - int(str(auto["depth_used"]))
            speed[f"b{b}_depth{auto['depth_used']}"] = auto
            speed[f"b{b}_depth{other}"] = bench_speed(b, str(other), a.repeats, speed_epochs)
            speed[f"b{b}_1epoch"] = bench_speed(b, "auto", a.repeats, 1)
            for name in ("", f"_depth{other}", "_1epoch"):
                s = speed[f"b{b}{name}"]
                print(f"  batch {b}, prefetch depth {s['prefetch_depth']} ({s['depth_used']}), "
                      f"{s['epochs']} epoch(s): local {s['local']:.0f}, distributed "
                      f"{s['distributed']:.0f} samples/s (medians of {a.repeats}): "
                      f"{s['ratio']:.2f}x", flush=True)
        for b in (128, 1024):
            for name in ("", "_depth1", "_depth2", "_1epoch"):
                results[f"speed_ratio_b{b}{name}"] = speed[f"b{b}{name}"]["ratio"]
        results["speed"] = speed
    if "cpu" in only:
        print("CPU per sample, whole job vs single process; collection and separate vs "
              "fused tables ...",
              flush=True)
        cpu = bench_cpu(1024, a.repeats, *a.cpu_epochs)
        results["cpu_ratio_b1024"] = cpu["cpu_ratio"]
        results["table_count_cpu_ratio"] = cpu["table_count_cpu_ratio"]
        results["separate_modules_cpu_ratio"] = cpu["separate_modules_cpu_ratio"]
        results["cpu"] = cpu
    if "growth" in only:
        print(f"growth: synthetic_ctr on 2 servers to {growth_rows:,} rows ...", flush=True)
        growth = bench_growth(growth_rows, 4096, 16)
        results["growth_ratio"] = growth["growth_ratio"]
        results["growth"] = growth
    if "tls" in only:
        print("TLS and the job secret on against off, 1 server + 1 worker at batch 1024 ...",
              flush=True)
        tls: dict[str, dict[str, Any]] = {}
        for name, transport in (("", "auto"), ("_grpc", "grpc")):
            t = tls[f"b1024{name}"] = bench_tls(1024, a.repeats, speed_epochs, transport)
            results[f"tls_step_ratio_b1024{name}"] = t["ratio"]
            used = {side: ", ".join(u) for side, u in t["transport_used"].items()}
            print(f"  transport {transport} (the worker uses {used['on']} with TLS, "
                  f"{used['off']} without), {t['epochs']} epoch(s): TLS on {t['on']:.0f}, off "
                  f"{t['off']:.0f} samples/s (medians of {a.repeats}): {t['ratio']:.2f}x",
                  flush=True)
        results["tls"] = tls

    print(f"\ntraining, {results['date']}, {results['machine']}")
    for m, v in results.get("auc", {}).items():
        delta = "" if m == "local" else f"  ({v - results['auc']['local']:+.4f} vs local)"
        print(f"  AUC {m:<6} {v:.4f}{delta}")
    if "speed" in results:
        for name, what in (("", f"prefetch depth auto, {speed_epochs} epochs"),
                           ("_depth1", f"prefetch depth 1, {speed_epochs} epochs"),
                           ("_depth2", f"prefetch depth 2, {speed_epochs} epochs"),
                           ("_1epoch", "prefetch depth auto, 1 epoch")):
            print(f"  speed 1+1 vs local, {what}: batch 128 "
                  f"{results[f'speed_ratio_b128{name}']:.2f}x (goal 0.8), batch 1024 "
                  f"{results[f'speed_ratio_b1024{name}']:.2f}x (goal 1.0)")
    if "cpu" in results:
        us = results["cpu"]["cpu_us_per_sample"]
        print(f"  CPU per sample at batch 1024: local {us['local']:.1f} us, job (fused) "
              f"{us['fused']:.1f} us = {results['cpu_ratio_b1024']:.2f}x (goal <= 2.0); "
              f"collection {us['collection']:.1f} us = "
              f"{results['table_count_cpu_ratio']:.2f}x fused (goal <= 1.15); separate "
              f"modules {us['separate']:.1f} us = "
              f"{results['separate_modules_cpu_ratio']:.2f}x fused")
    if "growth" in results:
        g = results["growth"]
        print(f"  growth to {g['rows']:,} rows: end/start {g['growth_ratio']:.2f}x "
              f"(goal 0.8); {g['bytes_per_row']:.0f} B/row = {g['row_memory_ratio']:.2f}x raw")
    if "tls" in results:
        auto_used = ", ".join(results["tls"]["b1024"]["transport_used"]["on"])
        print(f"  TLS + job secret on / off at batch 1024, {speed_epochs} epochs: transport "
              f"auto ({auto_used}) {results['tls_step_ratio_b1024']:.2f}x; transport grpc (TLS "
              f"carries every byte) {results['tls_step_ratio_b1024_grpc']:.2f}x")
    partial = "" if only == set(SECTIONS) else "-" + "-".join(s for s in SECTIONS if s in only)
    stem = f"training-{results['date']}{'-quick' if a.quick else ''}{partial}"
    saved = save(results, stem, a.json)
    if runs:
        plot_curves(runs, seeds, results["date"], saved.with_suffix(".png"))


def plot_curves(runs: dict[str, list[dict[str, Any]]], seeds: list[int], date: str,
                path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6, 4))
    for m, rs in runs.items():
        for i, r in enumerate(rs):
            curve = list(r["curve"])
            ax.plot([c[0] for c in curve], [c[1] for c in curve], marker=".",
                    color=f"C{list(runs).index(m)}", label=m if i == 0 else None, alpha=0.8)
    ax.set_xlabel("wall time since start (s)")
    ax.set_ylabel("test AUC after each epoch")
    ax.set_title(f"MovieLens-100k, {len(seeds)} seed(s) ({date})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")

if __name__ == "__main__":
    main()
