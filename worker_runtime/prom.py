"""Labels every series of a registry carries without each metric declaring them.

vLLM's series all carry `model_name`; tandem's routers, cluster collectors and workers
make theirs in several places, so the label is added where a registry is exported: a
collector that yields the inner registry's families with the labels put on every
sample (a sample's own label of the same name wins)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.registry import Collector


class ConstLabels(Collector):
    def __init__(self, inner: CollectorRegistry | Collector, labels: dict[str, str]) -> None:
        self.inner = inner
        self.labels = dict(labels)

    def collect(self):
        for family in self.inner.collect():
            family.samples = [s._replace(labels={**s.labels, **{k: v for k, v in self.labels.items()
                                                                 if k not in s.labels}}) for s in family.samples]
            yield family


def labelled(inner: CollectorRegistry | Collector, labels: dict[str, str]) -> CollectorRegistry:
    """A registry that exports `inner`'s series with `labels` on each."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(ConstLabels(inner, labels))
    return reg
