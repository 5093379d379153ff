"""The numeric bounds of the contract: what a record, a state file or an id may be at most.

One place for every limit both sides enforce, so a reader and a writer can never disagree on one.
"""

from __future__ import annotations

SCHEMA_VERSION = 1  # bumped only for breaking changes (see sentinel.contract.records)

MAX_RECORD_BYTES = 1 << 20  # a step record of a 4096-sample global batch is ~60 KB
MAX_JSON_DEPTH = 16  # our records nest 3 deep; Event.data a little more
MAX_STATE_BYTES = 64 << 20  # a state file (skip list, manifest, plan, config) is kilobytes; more is not one of ours

MAX_STEP = 2**53  # beyond this a float step counter would already have lost precision
MAX_TIMELINE = 2**31
MAX_COUNT = 2**62  # tokens, sample ids
MAX_MAGNITUDE = 3.5e38  # float32 max: no tensor of ours can produce a finite value beyond it
MAX_SAMPLE_ID = 2**63 - 1  # sample ids are int64 wherever they go (numpy, torch, the bus): HI at most this
INT64_MAX = 2**63 - 1  # counts in a checkpoint's manifest and train state
MAX_WORLD_SIZE = 1 << 20

MAX_DIRECTIVE_TTL_S = 86_400.0  # a directive that expires later than this after its issue is refused
MAX_CLOCK_SKEW_S = 600.0  # a directive issued later than this ahead of the reader's clock is refused

# data-mixture slice (source) names: also Prometheus label values, so short and bounded
SLICE_NAME_RE = r"[a-z0-9_]{1,32}"
MAX_SLICES = 16
