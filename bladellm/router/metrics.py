"""The instances' own /metrics, merged into one exposition with an ``instance`` label."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families


class _Merged:
    """A collector yielding each metric family once, with the samples of every instance."""

    def __init__(self, texts: dict[str, str]) -> None:
        self.texts = texts

    def describe(self) -> list[Metric]:
        return []  # names are only known at scrape time

    def collect(self) -> list[Metric]:
        families: dict[str, Metric] = {}
        for url, text in self.texts.items():
            try:
                parsed = list(text_string_to_metric_families(text))
            except ValueError:
                continue  # not Prometheus text: leave this instance out
            for fam in parsed:
                merged = families.get(fam.name)
                if merged is None:
                    merged = families[fam.name] = Metric(fam.name, fam.documentation, fam.type,
                                                         fam.unit)
                for s in fam.samples:
                    merged.add_sample(s.name, {**s.labels, "instance": url}, s.value,
                                      s.timestamp, s.exemplar)
        return list(families.values())


def render_instance_metrics(texts: dict[str, str]) -> bytes:
    """``texts`` maps an instance URL to the body of its /metrics."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged({url: t for url, t in texts.items() if t}))
    return generate_latest(registry)
