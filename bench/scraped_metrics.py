"""A daemon's Prometheus metrics as a bench reads them: every sample by its name, parsed by prometheus-client."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def scraped(url: str) -> dict[str, float]:
    """The samples `url` serves, keyed as Prometheus writes them: `name` or `name{label="value",...}`."""
    text = urllib.request.urlopen(url, timeout=30).read().decode()
    return {sample.name + ("{" + ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items())) + "}"
                           if sample.labels else ""): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}
