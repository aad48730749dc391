"""Request latency as an agent extension: the ``req`` event kind and its statistics.

It histograms each request per device, model and request class and keeps the sliding window
(``devices.window_s``) that the devices extension's verdicts read; the devices extension's
job publishes the histograms with each interval's device samples. The two share only the
neutral :mod:`infersight.latency`: the commands hand these statistics to the devices
extension. The status reply shows the statistics' size under ``requests``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from infersight.agent.daemon.assemble import KindHandler
from infersight.agent.daemon.extension import Apply, Extension
from infersight.agent.requests.kind import KIND, RequestStats
from infersight.latency import WINDOW_KEY
from infersight.settings import Config, setting


class RequestsExtension(Extension):
    name = "requests"
    live_keys: frozenset[str] = frozenset()  # devices.window_s applies at the next restart

    def __init__(self, stats: RequestStats) -> None:
        self.stats = stats

    @classmethod
    def from_config(cls, config: Config, env: Mapping[str, str] | None = None) -> RequestsExtension:
        """Raises ConfigError naming the key (and file:line) on a bad ``devices.window_s``."""
        return cls(RequestStats(setting(config, WINDOW_KEY, os.environ if env is None else env)))

    def kinds(self) -> Mapping[str, KindHandler]:
        return {KIND: self.stats.handle}

    def reload(self, config: Config) -> Apply | None:
        return None  # devices.window_s applies at the next restart

    def health(self) -> Mapping[str, Any]:
        return {"requests": self.stats.stats()}
