"""The Grafana dashboard of the gateway and the server (docs/grafana/glmserve-gateway.json) and its picture.

One panel list drives both: `python docs/grafana/dashboard.py json` writes the dashboard (PromQL per panel);
`python docs/grafana/dashboard.py render OUT.png --scrape URL/metrics [--scrape ...] --seconds S` scrapes the
given /metrics endpoints every --interval seconds for S seconds and draws every panel from those real samples,
computing what the panel's PromQL computes (per-second rates between scrapes summed by the panel's labels, gauges
summed, p99 from histogram bucket deltas). Panels whose metrics no endpoint exported are drawn as "no data".

Admission and billing metrics: glmserve/gateway/metrics.py; server: glmserve/server/metrics.py; proxy:
glmserve/gateway/proxy_metrics.py (all `glmserve_gateway_*` but the server's `glmserve_*`).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
JSON_PATH = HERE / "glmserve-gateway.json"


@dataclass(frozen=True)
class Panel:
    title: str
    metrics: tuple[str, ...]  # exported sample names (counters with _total)
    kind: str  # rate | gauge | p99
    by: tuple[str, ...] = ()
    unit: str = "short"
    row: str = "Admission and billing"


PANELS = [
    Panel("401s by reason", ("glmserve_gateway_auth_failures_total",), "rate", ("reason",), "reqps"),
    Panel("Refused by limit, budget or model", ("glmserve_gateway_rejections_total",), "rate", ("reason",), "reqps"),
    Panel("Admitted requests by key", ("glmserve_gateway_admitted_total",), "rate", ("key",), "reqps"),
    Panel("Tokens billed by kind", ("glmserve_gateway_key_tokens_total",), "rate", ("kind",)),
    Panel("Cost billed vs without cache discount (micro-USD/s)",
          ("glmserve_gateway_key_cost_micro_usd_total", "glmserve_gateway_key_list_cost_micro_usd_total"), "rate"),
    Panel("Limit backend up / per-process fallback",
          ("glmserve_gateway_limit_backend_up", "glmserve_gateway_limit_fallback"), "gauge"),
    Panel("Admitted but unbilled (no usage)", ("glmserve_gateway_unbilled_requests_total",), "rate", ("reason",),
          "reqps"),
    Panel("Finishes by reason and max_tokens source", ("glmserve_request_finished_by_limit_total",), "rate",
          ("finish_reason", "limit_source"), "reqps", "Server"),
    Panel("Output budget lost to the server cap (tokens/s)", ("glmserve_output_budget_lost_tokens_total",), "rate",
          (), "short", "Server"),
    Panel("Upstream requests by status", ("glmserve_gateway_upstream_requests_total",), "rate", ("status",), "reqps",
          "Proxy"),
    Panel("Retries by reason", ("glmserve_gateway_retries_total",), "rate", ("reason",), "reqps", "Proxy"),
    Panel("Upstream timeouts by kind", ("glmserve_gateway_timeouts_total",), "rate", ("kind",), "reqps", "Proxy"),
    Panel("Backend healthy", ("glmserve_gateway_backend_healthy",), "gauge", ("backend",), "short", "Proxy"),
    Panel("Breaker state (0 closed, 1 half-open, 2 open)", ("glmserve_gateway_breaker_state",), "gauge",
          ("backend",), "short", "Proxy"),
    Panel("Upstream first byte p99", ("glmserve_gateway_upstream_first_byte_seconds",), "p99", (), "s", "Proxy"),
]


def promql(panel: Panel, metric: str) -> str:
    by = f" by ({', '.join(panel.by)})" if panel.by else ""
    if panel.kind == "rate":
        return f"sum{by} (rate({metric}[$__rate_interval]))"
    if panel.kind == "p99":
        return f"histogram_quantile(0.99, sum by (le) (rate({metric}_bucket[$__rate_interval])))"
    return f"sum{by} ({metric})"


def dashboard() -> dict:
    panels, y, rows = [], 0, []
    for panel in PANELS:
        if panel.row not in rows:
            rows.append(panel.row)
    pid = 1
    for row in rows:
        panels.append({"type": "row", "title": row, "id": pid, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}})
        pid, y = pid + 1, y + 1
        for i, panel in enumerate(p for p in PANELS if p.row == row):
            legend = "{{" + "}} {{".join(panel.by) + "}}" if panel.by else None
            targets = [{"refId": chr(65 + k), "expr": promql(panel, m), "datasource": {"uid": "${datasource}"},
                        "legendFormat": legend or m.removeprefix("glmserve_").removesuffix("_total")}
                       for k, m in enumerate(panel.metrics)]
            panels.append({"type": "timeseries", "title": panel.title, "id": pid,
                           "datasource": {"uid": "${datasource}"},
                           "gridPos": {"h": 8, "w": 8, "x": 8 * (i % 3), "y": y + 8 * (i // 3)},
                           "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []}, "targets": targets})
            pid += 1
        y += 8 * ((sum(p.row == row for p in PANELS) + 2) // 3)
    return {"title": "glmserve gateway", "uid": "glmserve-gateway", "schemaVersion": 39, "version": 1,
            "time": {"from": "now-1h", "to": "now"}, "refresh": "10s", "tags": ["glmserve"],
            "templating": {"list": [{"name": "datasource", "type": "datasource", "query": "prometheus"}]},
            "panels": panels}


# -- the picture ---------------------------------------------------------------------------------------------
def scrape(urls: list[str], seconds: float, interval: float) -> list[tuple[float, dict]]:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    samples = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        now, values = time.monotonic(), {}
        for url in urls:
            try:
                text = httpx.get(url, timeout=5).text
            except httpx.HTTPError:
                continue
            for family in text_string_to_metric_families(text):
                for s in family.samples:
                    values[(url, s.name, tuple(sorted(s.labels.items())))] = s.value
        samples.append((now, values))
        time.sleep(max(0.0, interval - (time.monotonic() - now)))
    return samples


def _group(labels: tuple, by: tuple[str, ...]) -> str:
    d = dict(labels)
    return " ".join(d.get(b, "") for b in by)


def _increase(now: float, before: float | None) -> float:
    """A counter's increase between two scrapes of one endpoint; a lower value is a restart (as Prometheus reads
    a counter reset), a series an endpoint did not export before counts from zero."""
    if before is None:
        return now
    return now - before if now >= before else now


def series(panel: Panel, samples: list[tuple[float, dict]]) -> dict[str, tuple[list[float], list[float]]]:
    """Per legend label: (seconds since the first scrape, value), summed over endpoints."""
    out: dict[str, tuple[list[float], list[float]]] = {}
    t0 = samples[0][0]
    for (ta, a), (tb, b) in zip(samples, samples[1:]) if panel.kind != "gauge" else zip(samples, samples):
        point: dict[str, float] = {}
        for metric in panel.metrics:
            if panel.kind == "p99":
                buckets: dict[float, float] = {}
                for (url, name, labels), v in b.items():
                    if name == metric + "_bucket":
                        le = float(dict(labels)["le"])
                        buckets[le] = buckets.get(le, 0.0) + _increase(v, a.get((url, name, labels)))
                total = buckets.get(float("inf"), 0.0)
                if total > 0:
                    point["p99"] = _quantile(sorted(buckets.items()), 0.99 * total)
                continue
            for (url, name, labels), v in b.items():
                if name != metric:
                    continue
                label = (_group(labels, panel.by) or metric.removeprefix("glmserve_").removesuffix("_total"))
                value = v if panel.kind == "gauge" else _increase(v, a.get((url, name, labels))) / (tb - ta)
                point[label] = point.get(label, 0.0) + value
        for label, value in point.items():
            xs, ys = out.setdefault(label, ([], []))
            xs.append(tb - t0)
            ys.append(value)
    return out


def _quantile(buckets: list[tuple[float, float]], rank: float) -> float:
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if bound == float("inf"):
                return lower_bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / max(count - lower_count, 1e-12)
        lower_bound, lower_count = bound, count
    return lower_bound


def render(out: Path, samples: list[tuple[float, dict]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols, rows = 3, (len(PANELS) + 2) // 3
    fig, axes = plt.subplots(rows, cols, figsize=(18, 3.2 * rows), facecolor="#111217")
    for ax, panel in zip(axes.flat, PANELS):
        ax.set_facecolor("#181b1f")
        ax.set_title(f"{panel.row}: {panel.title}", color="#d8d9da", fontsize=9, loc="left")
        ax.tick_params(colors="#8e8e8e", labelsize=7)
        for spine in ax.spines.values():
            spine.set_color("#2c3235")
        ax.grid(color="#2c3235", linewidth=0.5)
        drawn = series(panel, samples)
        if not drawn:
            ax.text(0.5, 0.5, "no data", color="#8e8e8e", ha="center", va="center", transform=ax.transAxes)
        for label, (xs, ys) in sorted(drawn.items()):
            ax.plot(xs, ys, linewidth=1.2, label=label)
        if drawn:
            ax.legend(fontsize=6, loc="upper left", facecolor="#181b1f", labelcolor="#d8d9da", edgecolor="#2c3235")
        ax.set_xlabel("seconds", color="#8e8e8e", fontsize=7)
    for ax in list(axes.flat)[len(PANELS):]:
        ax.set_visible(False)
    fig.suptitle("glmserve gateway (rendered from scraped samples; same panels as glmserve-gateway.json)",
                 color="#d8d9da", fontsize=11)
    fig.tight_layout()
    fig.savefig(out, dpi=80, facecolor=fig.get_facecolor())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("json")
    r = sub.add_parser("render")
    r.add_argument("out", type=Path)
    r.add_argument("--scrape", action="append", required=True, metavar="URL")
    r.add_argument("--seconds", type=float, default=60)
    r.add_argument("--interval", type=float, default=1.0)
    args = parser.parse_args()
    if args.command == "json":
        JSON_PATH.write_text(json.dumps(dashboard(), indent=2) + "\n")
        print(f"wrote {JSON_PATH}")
        return
    render(args.out, scrape(args.scrape, args.seconds, args.interval))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
