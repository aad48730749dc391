"""The names and thresholds the hooks and the agent share (stdlib only, constants only).

The hooks set these attributes on the spans they send; the agent (assembly, metrics, MQTT,
the report, the exporters through :mod:`infersight.coldstart_stages` and
:mod:`infersight.weights_files`) reads them. Both sides import them from here, so that a
name or a threshold is defined once. With :mod:`_wire` (frames), :mod:`_paths` (where) and
:mod:`_env` (the ``INFERSIGHT_*`` variables) this is the hooks <-> agent contract
(``docs/wire.md``). The names are public: they are span attributes in every export.
"""

from __future__ import annotations

# -- span attributes ---------------------------------------------------------------------

STAGE = "infersight.stage"  # the stage a span stands for (else the name after "coldstart.")
STAGE_CUSTOM = "infersight.stage.custom"  # True: a stage the user named (hooks.stage)
STAGE_RULE = "infersight.stage.rule"  # the stage rule that opened it (rules.d)
# a stage opened by a task (thread context) that another stage made, after that stage had ended: its name; the span
# hangs under the stage that was open around its start instead (the root at the top)
STAGE_STARTED_IN = "infersight.stage.started_in"
ENDED_BY = "infersight.coldstart.ended_by"  # on a root: what ended the cold start (ENDED_BY_*)
READY_S = "infersight.coldstart.ready_s"  # on a root: seconds from its start to readiness
UNATTRIBUTED_S = "infersight.coldstart.unattributed_s"  # on a root: seconds in no stage
# on a root, from the hooks: seconds its own stages covered (an agent restarted during the cold start holds
# only the stages sent after it came back, and would count the rest as time in no stage)
COVERED_S = "infersight.coldstart.covered_s"
# on a supervisor's root (gunicorn's arbiter, Hypercorn's main process with workers), at its end: how many of its
# workers reported the end of their cold start to it, and how many of those were ever ready (a worker that failed
# to boot, or was stopped while it loaded, reports ENDED_BY_EXIT)
WORKERS = "infersight.coldstart.workers"
WORKERS_READY = "infersight.coldstart.workers_ready"
READY_SOURCE = "infersight.ready.source"  # on ready_wait and a root: which READY_SIGNALS said when
PROCESS_ROLE = "infersight.process.role"  # on a root: ROLE_HELPER for processes that serve nothing
FIRST_REQUEST_SOURCE = "infersight.first_request.source"
FIRST_REQUEST_TTFB_S = "infersight.first_request.ttfb_s"
COMPILE_CACHE = "infersight.compile.cache"  # hit, miss or mixed
UNATTRIBUTED_TOP = "infersight.unattributed.top"  # on an unattributed gap: the sampler's top frames
UNATTRIBUTED_SAMPLES = "infersight.unattributed.samples"  # ... and how many samples it took there
WEIGHTS = "infersight.weights."  # the prefix of the weights attributes below
WEIGHTS_PATH = WEIGHTS + "path"
WEIGHTS_BYTES = WEIGHTS + "bytes"
WEIGHTS_BYTES_PER_S = WEIGHTS + "bytes_per_s"
WEIGHTS_LAZY = WEIGHTS + "lazy"
WEIGHTS_PAGE_CACHE_RATIO = WEIGHTS + "page_cache_ratio"  # share of the file the page cache held
WEIGHTS_CEILING_RATIO = WEIGHTS + "ceiling_ratio"  # bytes_per_s over the storage's ceiling

# -- values ------------------------------------------------------------------------------

# Stages (STAGE values; a stage span is named ``coldstart.<stage>``) that the agent reads.
READY_WAIT = "ready_wait"  # from the start of readiness waiting to readiness (READY_SOURCE says which)
FIRST_REQUEST = "first_request"  # the first request, from its arrival to its response
WEIGHTS_LOAD = "weights_load"  # reading a weights file (the WEIGHTS_* attributes)
UNATTRIBUTED = "unattributed"  # a gap no stage covers (the sampler's UNATTRIBUTED_* attributes)

ROLE_HELPER = "helper"
ENDED_BY_READY = "ready"
ENDED_BY_FIRST_REQUEST = FIRST_REQUEST
ENDED_BY_EXIT = "exit"
ENDED_BY_PRODUCER_LOST = "producer_lost"  # the agent closed it: the process died first
ENDED_BY_WORKERS = "workers"  # a supervisor's: it served through a worker (its first ready one)

# Readiness signals (READY_SOURCE values): the root ends at readiness when one of these said
# when it came. A request that arrives first ("request") is no signal: the first response
# ends the root then. The agent closes a dead producer's root the same way.
READY_SIGNALS = ("mark_ready", "listen", "ready_url", "listening_socket", "stage_rule", "fork_served")

# Serving engines' packages: a process that imports one rings a held launch's doorbell (hooks._activate, with
# _wire.ENGINE_FRAME), and the agent loads its OOM rules when a framework_import stage names one
# (agent.commands.launch_agent). An engine's memory errors come while it starts (weights too large, no room for
# the KV cache).
ENGINE_PACKAGES = ("vllm", "sglang", "text_generation_server", "lmdeploy", "tensorrt_llm")

# -- thresholds --------------------------------------------------------------------------

COLD_BELOW = 0.5  # WEIGHTS_PAGE_CACHE_RATIO under this: a cold read (the storage ceiling applies)
MIN_GAP_SAMPLES = 5  # fewer samples in an unattributed gap name no frame (50 ms at 10 ms)
