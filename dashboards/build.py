"""Grafana dashboards as code (grafana-foundation-sdk, pinned in pyproject's ``dashboards`` extra).

    pip install 'grafana-foundation-sdk==1769699379!11.6.0'   # the 11.6 build (a plain install gets 10.1)
    python -m dashboards.build            # regenerate dashboards/training.json and dashboards/sentinel.json
    python -m dashboards.build --check    # exit 1 if a committed JSON differs from the builder's output

* ``training.json`` - the operator dashboard. A top line of stats (step, loss, tokens/s, MFU, open
  incidents, checkpoint age), then the panels in the "60-second inspection order": optimization
  first (loss, val PPL, grad norm), then systems (tokens/s, MFU, step time, phases, checkpoints),
  then slice eval (is the regression global or one bucket: per-slice validation loss and PPL,
  probe sets, per-source train loss, mixture weights), then restores and per-rank health.
* ``sentinel.json`` - is the sentinel itself alive, leading, keeping up and acting?

Both take ``run`` as a multi-select (with All) and the training dashboard also ``rank``; they link
to each other (keeping the time range and the variables), and each panel links to the runbook of
every alert that reads its series. Every panel has a unit and thresholds (a single base colour
where no level is a red flag); panels tile the 24-column grid without holes.

Timeline events (resumes and rollbacks; LR phases: warmup end, decay start; data changes: mixture
and sequence-length changes) and sentinel actions are dashboard *annotations*, so every graph shares
one timeline ("did the loss spike right after a resume? right after the mixture changed?"). One small function per panel, shared
defaults, a ``ref_id`` on every query, JSON encoded with sorted keys so diffs stay clean.
Metric names and labels: docs/metrics.md (trainer) and sentinel/metrics.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from grafana_foundation_sdk.builders import common as common_b
from grafana_foundation_sdk.builders import dashboard as dash_b
from grafana_foundation_sdk.builders import stat, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as dash_m

from alerts.build import runbook_url, write_or_check
from dashboards.common import (
    RATE,
    RUN,
    RUN_RANK,
    UIDS,
    annotation,
    base_dashboard,
    default_stat,
    default_timeseries,
    increase,
    query,
    right_axis,
)

HERE = Path(__file__).resolve().parent


# ------------------------------------------------------------------ annotations (shared timeline)
def sentinel_action_annotation() -> dash_b.AnnotationQuery:
    # Not `changes(...)`: the gauge is created by the first action, so its first sample is already the
    # action's time and `changes` would miss it. Mark the minute after each action instead.
    return annotation("Sentinel actions",
                      f"(time() - sentinel_last_action_timestamp_seconds{{{RUN}}}) < 60", "purple")


def timeline_annotation(name: str, events: tuple[str, ...], color: str) -> dash_b.AnnotationQuery:
    # training_timeline_events_total is pre-initialised to 0 for every event, so `changes` sees the first one.
    sel = f'{RUN}, event=~"{"|".join(events)}"'
    return annotation(name, f"changes(training_timeline_events_total{{{sel}}}[1m]) > 0", color,
                      title="{{event}}", tags="event")


def training_annotations() -> list[dash_b.AnnotationQuery]:
    # "Did the spike come right after X?": every change of training conditions is a marker on every
    # panel, coloured by kind and titled with the event.
    return [
        timeline_annotation("Resumes and rollbacks", ("resume", "rollback"), "red"),
        timeline_annotation("LR phases (warmup end, decay start)", ("warmup_end", "decay_start"), "blue"),
        timeline_annotation("Data changes (mixture, seq len)", ("mixture_change", "seq_len_change"), "green"),
        sentinel_action_annotation(),
        annotation("Skipped steps",
                   f"sum by (run, reason) (increase(training_skipped_steps_total{{{RUN}}}[1m])) > 0", "yellow"),
    ]


# ------------------------------------------------------------------ training: the top line of stats
MFU_LEVELS = ((None, "red"), (0.15, "orange"), (0.3, "green"))
CKPT_AGE_LEVELS = ((None, "green"), (3600, "orange"), (7200, "red"))  # red: TrainingCheckpointTooOld


def top_stats() -> list[stat.Panel]:
    return [
        default_stat("none", alerts=("TrainingStalled",)).title("Step")
        .description("Last completed optimizer step (goes back on a rollback).")
        .with_target(query(f"training_step{{{RUN}}}", "", "A")),
        default_stat("none", alerts=("TrainingLossSpike",)).title("Loss")
        .description("Global mean training loss of the last step.")
        .with_target(query(f"training_loss{{{RUN}}}", "", "A")),
        default_stat("short", alerts=("TrainingThroughputLow",)).title("Tokens/s")
        .description("Global tokens per second over the last 20 steps.")
        .with_target(query(f"training_tokens_per_second{{{RUN}}}", "", "A")),
        default_stat("percentunit", *MFU_LEVELS).title("MFU")
        .description("Model FLOPs utilisation. Empty when the device's peak FLOP/s is unknown (CPU, unlisted GPU: "
                     "set telemetry.peak_flops). Below 15 % on a GPU: look at the step breakdown.")
        .with_target(query(f"training_mfu_ratio{{{RUN}}}", "", "A")),
        default_stat("none", (None, "green"), (1, "red"), alerts=("SentinelEscalation",)).title("Open incidents")
        .description("Incidents the sentinel has open on the run (none: green).")
        .with_target(query(f"max by (run) (sentinel_incidents_open{{{RUN}}})", "", "A")),
        default_stat("s", *CKPT_AGE_LEVELS, alerts=("TrainingCheckpointTooOld",)).title("Checkpoint age")
        .description("Seconds since the last successful checkpoint (since the process started, before the first). "
                     "Red at 2 hours, where TrainingCheckpointTooOld fires.")
        .with_target(query(f"training_checkpoint_age_seconds{{{RUN}}}", "", "A")),
    ]


# ------------------------------------------------------------------ training: 1. optimization
def loss_panel() -> timeseries.Panel:
    return (default_timeseries("none", alerts=("TrainingLossSpike", "TrainingNonFiniteSkips"))
            .title("Train loss and validation perplexity")
            .description("Healthy: a smooth decline. Red flag: a sudden spike, oscillation, validation perplexity "
                         "not improving or diverging from train. First move: align the timeline (annotations: "
                         "resumes, rollbacks, sentinel actions, skips).")
            .with_target(query(f"training_loss{{{RUN}}}", "train loss", "A"))
            .with_target(query(f"training_validation_loss{{{RUN}}}", "val loss", "B"))
            .with_target(query(f"exp(training_validation_loss{{{RUN}}})", "val PPL", "C"))
            .override_by_query("C", right_axis("C", "none")))


def grad_norm_panel() -> timeseries.Panel:
    clipped = (f"sum by (run) (rate(training_grad_clipped_steps_total{{{RUN}}}[{RATE}]))"
               f" / max by (run) (rate(training_step_duration_seconds_count{{{RUN}}}[{RATE}]))")
    return (default_timeseries("none").title("Grad norm (pre-clip) and clipped-step share")
            .description("Healthy: noisy but bounded. Red flag: a sudden spike or periodic jitter, clipping on "
                         "most steps. First move: stabilize first, replay next (sentinel replay-batch).")
            .with_target(query(f"training_grad_norm{{{RUN}}}", "grad norm (pre-clip)", "A"))
            .with_target(query(clipped, "clipped steps share", "B"))
            .override_by_query("B", right_axis("B", "percentunit")))


def learning_rate_panel() -> timeseries.Panel:
    return (default_timeseries("sci").title("Learning rate")
            .description("Unexpected jump: schedule or restore error. Align it with loss spikes.")
            .with_target(query(f"training_learning_rate{{{RUN}}}", "lr", "A")))


def rank_loss_spread_panel() -> timeseries.Panel:
    spread = f"max by (run) (training_rank_loss{{{RUN_RANK}}}) - min by (run) (training_rank_loss{{{RUN_RANK}}})"
    return (default_timeseries("none").title("Rank loss spread (max - min)")
            .description("One rank far above the others: bad data on that rank's shard or a faulty device.")
            .with_target(query(spread, "spread", "A"))
            .with_target(query(f"training_rank_loss{{{RUN_RANK}}}", "rank {{rank}}", "B")))


# ------------------------------------------------------------------ training: 2. systems
def throughput_panel() -> timeseries.Panel:
    return (default_timeseries("short", alerts=("TrainingThroughputLow",)).title("Tokens/s and MFU")
            .description("Red flag: persistently below target; high utilisation but low MFU (kernel, communication "
                         "or input starvation). First move: check the step breakdown.")
            .with_target(query(f"training_tokens_per_second{{{RUN}}}", "tokens/s", "A"))
            .with_target(query(f"training_mfu_ratio{{{RUN}}}", "MFU", "B"))
            .override_by_query("B", right_axis("B", "percentunit")))


def step_time_panel() -> timeseries.Panel:
    def q(p: str) -> str:
        return (f"histogram_quantile({p}, sum by (run, rank, le) "
                f"(rate(training_step_duration_seconds_bucket{{{RUN_RANK}}}[{RATE}])))")

    # busy time = the step minus its wait at the all-reduce: under DDP every rank's *wall* step time is
    # the same (the fast ones wait for the slow one), so only busy time names the straggler (the same
    # expression as the TrainingRankStraggler alert and the sentinel's rank_straggler rule)
    busy = (f"sum by (run, rank) (rate(training_step_phase_seconds_sum{{{RUN_RANK}, phase=~\"data_wait|forward_backward|optimizer\"}}[{RATE}]))"
            f" / sum by (run, rank) (rate(training_step_phase_seconds_count{{{RUN_RANK}, phase=\"forward_backward\"}}[{RATE}]))")
    return (default_timeseries("s", alerts=("TrainingRankStraggler",))
            .title("Busy time per step per rank (straggler), step time p99")
            .description("Busy time per step (data wait + forward/backward + optimizer, without the all-reduce "
                         "wait) per rank: a rank above the others is a straggler, every other rank waits for it. "
                         "Step wall time p99 is the same on every rank under DDP.")
            .with_target(query(busy, "busy rank {{rank}}", "A"))
            .with_target(query(q("0.99"), "step p99 rank {{rank}}", "B")))


def phase_panel() -> timeseries.Panel:
    share = f"avg by (run, phase) (rate(training_step_phase_seconds_sum{{{RUN_RANK}}}[{RATE}]))"
    data_wait = (f"max by (run) (rate(training_step_phase_seconds_sum{{{RUN_RANK}, phase=\"data_wait\"}}[{RATE}])"
                 f" / on (run, rank) sum by (run, rank) (rate(training_step_phase_seconds_sum{{{RUN_RANK}}}[{RATE}])))")
    return (default_timeseries("percentunit", alerts=("TrainingInputStarvation",))
            .title("Step phase breakdown (share of wall time)")
            .description("Fraction of wall time per phase (mean over the selected ranks). A growing data_wait share "
                         "is input starvation; the dashed line is the worst rank's data_wait share of its step time.")
            .stacking(common_b.StackingConfig().mode(common.StackingMode.NORMAL))
            .with_target(query(share, "{{phase}}", "A"))
            .with_target(query(data_wait, "data_wait share (worst rank)", "B"))
            .override_by_query("B", [dash_m.DynamicConfigValue(id_val="custom.stacking", value={"mode": "none"}),
                                     dash_m.DynamicConfigValue(id_val="custom.lineStyle",
                                                               value={"fill": "dash", "dash": [10, 10]})]))


def effective_token_ratio_panel() -> timeseries.Panel:
    return (default_timeseries("percentunit", (None, "red"), (0.5, "orange"), (0.8, "green"))
            .title("Effective token ratio per rank")
            .description("Useful / loaded tokens. Falling: poor packing or many skipped samples (below 80 %: orange).")
            .with_target(query(f"training_effective_token_ratio{{{RUN_RANK}}}", "rank {{rank}}", "A")))


def checkpoint_age_panel() -> timeseries.Panel:
    return (default_timeseries("s", *CKPT_AGE_LEVELS, alerts=("TrainingCheckpointTooOld",)).title("Checkpoint age")
            .description("Red flag: too long without a checkpoint. First move: inspect the save/restore path "
                         "(sentinel checkpoints RUN). The lines are where TrainingCheckpointTooOld warns (2 hours).")
            .with_target(query(f"training_checkpoint_age_seconds{{{RUN}}}", "age", "A")))


def checkpoint_saves_panel() -> timeseries.Panel:
    p99 = (f"histogram_quantile(0.99, sum by (run, le) "
           f"(rate(training_checkpoint_save_duration_seconds_bucket{{{RUN}}}[{RATE}])))")
    return (default_timeseries("s", alerts=("TrainingCheckpointFailing", "TrainingDiskFull"))
            .title("Checkpoint save time, size and failures")
            .description("Growing save time: storage jitter or write blocking. Any failure deserves a look.")
            .with_target(query(p99, "save p99", "A"))
            .with_target(query(f"increase(training_checkpoint_failures_total{{{RUN}}}[{RATE}])", "failures", "B"))
            .with_target(query(f"training_checkpoint_size_bytes{{{RUN}}}", "size", "C"))
            .override_by_query("B", [dash_m.DynamicConfigValue(id_val="unit", value="short")])
            .override_by_query("C", right_axis("C", "bytes")))


# ------------------------------------------------------------------ training: 3. slice eval
# Slice gauges read 0 until a slice's first value (the exporter declares every slice at start): `> 0`
# keeps that 0 off the plots, where it would read as a perfect loss.
def slice_val_loss_panel() -> timeseries.Panel:
    return (default_timeseries("none", alerts=("TrainingSliceRegressing",)).title("Validation loss per slice")
            .description("Healthy: critical slices improve together. Red flag: one domain keeps regressing "
                         "(mixture, tokenizer, contamination). First move: localize to a bucket first - which "
                         "slice, since which annotation? Aggregate validation perplexity hides it.")
            .with_target(query(f"training_validation_slice_loss{{{RUN}}} > 0", "{{slice}}", "A")))


def slice_regression_panel() -> timeseries.Panel:
    cur = f"max by (run, slice) (training_validation_slice_loss{{{RUN}}} > 0)"
    return (default_timeseries("none", (None, "green"), (0.1, "red"), alerts=("TrainingSliceRegressing",))
            .title("Validation loss above its 2-hour best, per slice")
            .description("What TrainingSliceRegressing and the sentinel's slice_regression rule look at: a slice "
                         "above the 0.1-nat line while the others sit at 0 (still improving) is regressing.")
            .with_target(query(f"{cur} - min_over_time(({cur})[2h:])", "{{slice}}", "A")))


def slice_val_ppl_panel() -> timeseries.Panel:
    return (default_timeseries("none").title("Validation perplexity per slice")
            .description("exp(slice validation loss): the per-bucket view of the validation perplexity above.")
            .with_target(query(f"exp(training_validation_slice_loss{{{RUN}}} > 0)", "{{slice}}", "A")))


def probe_loss_panel() -> timeseries.Panel:
    return (default_timeseries("none").title("Probe-set loss per slice")
            .description("A small fixed probe set per slice, run at every eval: the early warning. A probe "
                         "rising before the slice's validation loss does is the first sign of a regressing bucket.")
            .with_target(query(f"training_probe_loss{{{RUN}}} > 0", "{{slice}}", "A")))


def source_train_loss_panel() -> timeseries.Panel:
    return (default_timeseries("none").title("Train loss per source")
            .description("Mean training loss of each source's samples in the last step. Rising with its validation "
                         "loss: that source's training data changed (corruption, tokenizer). Falling while its "
                         "validation rises: the slice's train and val data disagree.")
            .with_target(query(f"training_slice_loss{{{RUN}}} > 0", "{{slice}}", "A")))


def mixture_weights_panel() -> timeseries.Panel:
    return (default_timeseries("percentunit").title("Mixture weights")
            .description("Sampling weight of each source now in effect (they sum to 1). A weight that moved right "
                         "before a slice regressed or the loss spiked is the first suspect (see the data-change "
                         "annotations).")
            .stacking(common_b.StackingConfig().mode(common.StackingMode.NORMAL))
            .with_target(query(f"training_mixture_weight_ratio{{{RUN}}}", "{{slice}}", "A")))


# ------------------------------------------------------------------ training: 4. restores, skips, rank health
def skips_panel() -> timeseries.Panel:
    return (default_timeseries("short", alerts=("TrainingNonFiniteSkips",)).title("Skipped steps by reason")
            .description("Steps whose update was dropped. Increasingly frequent: the run is approaching its "
                         "stability boundary - do not keep gambling because it recovered.")
            .with_target(increase("training_skipped_steps_total", "run, reason", "{{reason}}", "A"))
            .with_target(increase("training_skipped_samples_total", "run", "skipped samples (skip list)", "B",
                                  RUN_RANK)))


def restores_panel() -> timeseries.Panel:
    return (default_timeseries("short").title("Resumes and rollbacks")
            .description("Abnormal restores. Compare with the loss: did the spike happen right after a resume?")
            .with_target(query(f"increase(training_resumes_total{{{RUN}}}[{RATE}])", "resumes", "A"))
            .with_target(query(f"increase(training_rollbacks_total{{{RUN}}}[{RATE}])", "rollbacks", "B")))


def memory_panel() -> timeseries.Panel:
    return (default_timeseries("bytes").title("Memory per rank")
            .description("Creeping up: a leak. CUDA reserved near device memory: OOM ahead. "
                         "CUDA series exist only on GPU runs.")
            .with_target(query(f"process_resident_memory_bytes{{{RUN_RANK}}}", "host RSS rank {{rank}}", "A"))
            .with_target(query(f"training_cuda_memory_allocated_bytes{{{RUN_RANK}}}", "CUDA allocated rank {{rank}}", "B"))
            .with_target(query(f"training_cuda_memory_reserved_bytes{{{RUN_RANK}}}", "CUDA reserved rank {{rank}}", "C")))


def heartbeat_panel() -> timeseries.Panel:
    return (default_timeseries("s", (None, "green"), (120, "orange"), (300, "red"),
                               alerts=("TrainingHeartbeatStale", "TrainingStalled"))
            .title("Heartbeat age per rank")
            .description("Seconds since each rank was last alive. Above 5 minutes: that rank hangs "
                         "(TrainingHeartbeatStale).")
            .with_target(query(f"time() - training_heartbeat_timestamp_seconds{{{RUN_RANK}}}", "rank {{rank}}", "A")))


def telemetry_panel() -> timeseries.Panel:
    return (default_timeseries("short", alerts=("TrainingTelemetryDropping", "TrainingDirectivesRejected",
                                                "TrainingRankDown"))
            .title("Telemetry drops, directives, scrape health").span(24)
            .description("Dropped telemetry: the sentinel is partly blind. Rejected directives: bad signature, "
                         "expired or invalid. up == 0 names the rank whose endpoint is down.")
            .with_target(increase("training_telemetry_dropped_total", "run, rank", "dropped rank {{rank}}", "A",
                                  RUN_RANK))
            .with_target(increase("training_directives_rejected_total", "run", "directives rejected", "B"))
            .with_target(increase("training_directives_applied_total", "run, kind", "applied {{kind}}", "C"))
            .with_target(query(f"up{{{RUN_RANK}}}", "up rank {{rank}}", "D")))


def training_dashboard() -> dash_b.Dashboard:
    d = base_dashboard("Sentinel / Training run", UIDS["training"],
                       "Operator view of pretraining runs, in the 60-second inspection order: optimization, "
                       "systems, slice eval, then restores and rank health.", rank=True)
    for a in training_annotations():
        d = d.annotation(a)
    for s in top_stats():
        d = d.with_panel(s)
    return (
        d.with_row(dash_b.Row("1. Optimization: loss, val PPL, grad norm"))
        .with_panel(loss_panel())
        .with_panel(grad_norm_panel())
        .with_panel(learning_rate_panel())
        .with_panel(rank_loss_spread_panel())
        .with_row(dash_b.Row("2. Systems: tokens/s, MFU, step time, checkpoints"))
        .with_panel(throughput_panel())
        .with_panel(step_time_panel())
        .with_panel(phase_panel())
        .with_panel(effective_token_ratio_panel())
        .with_panel(checkpoint_age_panel())
        .with_panel(checkpoint_saves_panel())
        .with_row(dash_b.Row("3. Slice eval: is it global or one bucket?"))
        .with_panel(slice_val_loss_panel())
        .with_panel(slice_regression_panel())
        .with_panel(slice_val_ppl_panel())
        .with_panel(probe_loss_panel())
        .with_panel(source_train_loss_panel())
        .with_panel(mixture_weights_panel())
        .with_row(dash_b.Row("4. Restores, skips and rank health"))
        .with_panel(skips_panel())
        .with_panel(restores_panel())
        .with_panel(memory_panel())
        .with_panel(heartbeat_panel())
        .with_panel(telemetry_panel())
    )


# ------------------------------------------------------------------ sentinel panels
def sentinel_stats() -> list[stat.Panel]:
    return [
        default_stat("none", (None, "green"), (1, "red"), alerts=("SentinelEscalation",), span=6).title("Open incidents")
        .description("Incidents the sentinel has open on the run.")
        .with_target(query(f"max by (run) (sentinel_incidents_open{{{RUN}}})", "", "A")),
        default_stat("none", (None, "red"), (1, "green"), (2, "red"),
                     alerts=("SentinelNoLeader", "SentinelSplitBrain", "SentinelDown"), span=6)
        .title("Leaders holding the lease")
        .description("Exactly 1 is healthy: 0 = nobody acts on the run, more than 1 = split brain.")
        .with_target(query(f"sum by (run) (sentinel_leader{{{RUN}}})", "", "A")),
        default_stat("none", (None, "green"), (100, "orange"), (1000, "red"), alerts=("SentinelCannotKeepUp",), span=6)
        .title("Step records not yet read")
        .description("Records on the run's step stream that the sentinel has not read (its lag).")
        .with_target(query(f"max by (run) (sentinel_stream_lag_records{{{RUN}}})", "", "A")),
        default_stat("s", span=6).title("Since the last action")
        .description("Seconds since the sentinel last acted on the run (any kind).")
        .with_target(query(f"time() - max by (run) (sentinel_last_action_timestamp_seconds{{{RUN}}})", "", "A")),
    ]


def sentinel_steps_panel() -> timeseries.Panel:
    return (default_timeseries("ops", alerts=("SentinelLagging",)).title("Steps processed vs trained")
            .description("The sentinel must keep up with the trainer; a gap means it lags or is down.")
            .with_target(query(f"sum by (run) (rate(sentinel_steps_processed_total{{{RUN}}}[{RATE}]))",
                               "sentinel steps/s", "A"))
            .with_target(query(f"max by (run) (rate(training_step_duration_seconds_count{{{RUN}}}[{RATE}]))",
                               "trainer steps/s", "B")))


def sentinel_rules_panel() -> timeseries.Panel:
    return (default_timeseries("short").title("Rules fired")
            .description("Rule firings after cooldowns, by rule.")
            .with_target(increase("sentinel_rule_fired_total", "run, rule", "{{rule}}", "A")))


def sentinel_actions_panel() -> timeseries.Panel:
    return (default_timeseries("short", alerts=("SentinelEscalation",)).title("Actions by outcome")
            .description("sent / duplicate / dry_run / failed, per action kind. 'page' means a human is needed.")
            .with_target(increase("sentinel_actions_total", "run, action, outcome", "{{action}} {{outcome}}", "A")))


def sentinel_latency_panel() -> timeseries.Panel:
    p99 = (f"histogram_quantile(0.99, sum by (run, le) "
           f"(rate(sentinel_detection_latency_seconds_bucket{{{RUN}}}[{RATE}])))")
    return (default_timeseries("s", (None, "green"), (1, "orange"), (5, "red")).title("Detection latency p99")
            .description("From step publish to signed directive in Redis (observed when a directive is sent). "
                         "Above a second: the sentinel acts a step or more late.")
            .with_target(query(p99, "p99", "A")))


def sentinel_verdict_panel() -> timeseries.Panel:
    # daemon-wide series (no run label), shown for the sentinel(s) leading the selected runs
    leading = f"and on (instance) (max by (instance) (sentinel_leader{{{RUN}}}) == 1)"

    def p(q: str) -> str:
        return (f"histogram_quantile({q}, sum by (instance, le) (rate(sentinel_verdict_latency_seconds_bucket[{RATE}]))) "
                f"{leading}")
    return (default_timeseries("s", (None, "green"), (0.25, "orange"), (1, "red"),
                               alerts=("SentinelVerdictsSlow", "SentinelWorkerDown"))
            .title("Verdict latency and CPU (the leading sentinel)")
            .description("From a step record's XADD to the rules' verdict, p50 and p99 over every run the sentinel "
                         "leads, and the daemon's CPU in cores (right axis; its workers' summed, with --workers). One "
                         "Python process: past ~0.85 of a core its bursts queue and the p99 climbs from tens of ms "
                         "towards seconds; share its runs over workers (sentinel run --workers K, one per core) or "
                         "more sentinels.")
            .with_target(query(p("0.5"), "{{instance}} p50", "A", per_run=False))
            .with_target(query(p("0.99"), "{{instance}} p99", "B", per_run=False))
            .with_target(query(f'sum by (instance) (rate(process_cpu_seconds_total{{job="sentinel"}}[{RATE}])) {leading}',
                               "{{instance}} CPU (cores)", "C", per_run=False))
            .override_by_query("C", right_axis("C", "none")).span(24))


def sentinel_bus_errors_panel() -> timeseries.Panel:
    return (default_timeseries("short", alerts=("SentinelBusErrors",)).title("Bus errors and last action age")
            .description("Control-bus errors (each retried; daemon-wide, no run label), and seconds since each "
                         "kind of action was last taken on the run.")
            .with_target(query(f"sum(increase(sentinel_bus_errors_total[{RATE}]))", "bus errors", "A", per_run=False))
            .with_target(query(f"time() - sentinel_last_action_timestamp_seconds{{{RUN}}}", "since {{action}}", "B"))
            .override_by_query("B", right_axis("B", "s")))


def sentinel_bus_input_panel() -> timeseries.Panel:
    return (default_timeseries("short", alerts=("SentinelRecordsRejected", "SentinelCannotKeepUp",
                                                "SentinelBusRestarted", "SentinelInternalError"))
            .title("Bus input: refused, trimmed unread, lag")
            .description("Step-stream entries the sentinel refused, by stream and reason (forged, malformed, newer "
                         "schema); step records the capped stream trimmed before the sentinel read them; records not "
                         "yet read (right axis); embedded buses restarted; polls that raised an unforeseen error. "
                         "The panel links to each alert's runbook.")
            .with_target(increase("sentinel_records_rejected_total", "run, stream, reason", "refused {{stream}} {{reason}}", "A"))
            .with_target(increase("sentinel_records_trimmed_unread_total", "run", "trimmed unread", "B"))
            .with_target(increase("sentinel_bus_restarts_total", "run", "bus restarts", "C"))
            .with_target(increase("sentinel_internal_errors_total", "run", "internal errors", "E"))
            .with_target(query(f"max by (run) (sentinel_stream_lag_records{{{RUN}}})", "lag (records)", "D"))
            .override_by_query("D", right_axis("D", "none")))


def sentinel_dashboard() -> dash_b.Dashboard:
    d = base_dashboard("Sentinel / Daemon health", UIDS["daemon"],
                       "Is the sentinel alive, leading, keeping up with the trainer, and what did it do?", rank=False)
    d = d.annotation(sentinel_action_annotation())
    # Watchdog concerns no panel (it fires always, to prove the alerting path works): a dashboard link
    d = d.link(dash_b.DashboardLink("Runbook: Watchdog").type(dash_m.DashboardLinkType.LINK).icon("doc")
               .url(runbook_url("Watchdog")).target_blank(True))
    for s in sentinel_stats():
        d = d.with_panel(s)
    return (
        d.with_panel(sentinel_steps_panel())
        .with_panel(sentinel_rules_panel())
        .with_panel(sentinel_actions_panel())
        .with_panel(sentinel_latency_panel())
        .with_panel(sentinel_bus_errors_panel())
        .with_panel(sentinel_bus_input_panel())
        .with_panel(sentinel_verdict_panel())
    )


# ------------------------------------------------------------------ output
DASHBOARDS = {"training.json": training_dashboard, "sentinel.json": sentinel_dashboard}


def render(name: str) -> str:
    return JSONEncoder(sort_keys=True, indent=2).encode(DASHBOARDS[name]().build()) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dashboards.build", description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if a committed JSON is stale")
    ap.add_argument("--out", type=Path, default=HERE, help="output directory (default: dashboards/)")
    args = ap.parse_args(argv)
    return write_or_check([(args.out / name, render(name)) for name in DASHBOARDS], check=args.check,
                          regenerate="python -m dashboards.build")


if __name__ == "__main__":
    sys.exit(main())
