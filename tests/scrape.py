"""Prometheus metrics as tests read them: a scrape, and one sample's value."""

from __future__ import annotations

import urllib.request


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        return str(reply.read().decode())


def value(text: str, metric: str, **labels: str) -> float:
    for line in text.splitlines():
        if not line.startswith(metric + "{") and not line.startswith(metric + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {metric} {labels} in:\n{text}")
