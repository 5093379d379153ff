"""The contract between the trainer and the sentinel: the layer everything else imports.

It imports nothing of ours and no torch, so ``trainer/``, ``sentinel.client``, the daemon and any
third-party tool can depend on it. One module per job:

* ``limits``: every numeric bound (record size, JSON depth, step, count, sample id, TTLs);
* ``parsing``: ``SchemaError``, its reject reasons and the bounded JSON parser;
* ``records``: the versioned pydantic records (step, timeline, marker, directive, ack, event,
  incident, checkpoint info);
* ``bounds``: range checks of a parsed record (``record_range_error``);
* ``signing``: record MACs and directive signatures (HMAC-SHA256);
* ``keys``: the Redis key and consumer-group names;
* ``ranges``: ``[lo, hi)`` sample-id range arithmetic, parsing and validation;
* ``rundir``: the run directory's file names and small state-file formats;
* ``checkpoints``: the checkpoint manifest and train-state schemas, and ``check_manifest``;
* ``fsio``: atomic write, directory fsync, sha256 of a file, bounded regular-file read;
* ``yamlio``: the one YAML loader (libyaml's when there), bounded reads, one-line errors;
* ``targets``: the rollback-target rule.

``sentinel.protocol`` re-exports the names most callers use, for compatibility.
"""
