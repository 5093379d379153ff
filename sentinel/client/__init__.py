"""sentinel's public client library: what a training loop needs to be watched and steered.

No torch here. Our trainer uses it, and so does every integration (Hugging Face, Lightning, your own loop)::

    from sentinel.client import BusClient, ControlLoop, StepRecord, SkipList
"""

from sentinel.client.bus import BusClient
from sentinel.client.checkpoints import checkpoint_info, write_manifest
from sentinel.client.control import Applied, ControlHost, ControlLoop, RelaunchRequired, RestoreFailed
from sentinel.client.session import RunSession
from sentinel.client.skiplist import DataError, SkipList
from sentinel.client.steplog import StepLog
from sentinel.protocol import Ack, CheckpointInfo, Directive, StepRecord, TimelineRecord

__all__ = [
    "Ack",
    "Applied",
    "BusClient",
    "CheckpointInfo",
    "ControlHost",
    "ControlLoop",
    "DataError",
    "Directive",
    "RelaunchRequired",
    "RestoreFailed",
    "RunSession",
    "SkipList",
    "StepLog",
    "StepRecord",
    "TimelineRecord",
    "checkpoint_info",
    "write_manifest",
]
