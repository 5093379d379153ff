"""Shared building blocks of the dashboards (dashboards/build.py): queries scoped to the selected
runs and ranks, panels with a unit and thresholds and links to runbooks, the variables, the links
between the two dashboards, Prometheus annotations."""

from __future__ import annotations

from grafana_foundation_sdk.builders import common as common_b
from grafana_foundation_sdk.builders import dashboard as dash_b
from grafana_foundation_sdk.builders import prometheus, stat, timeseries
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as dash_m

from alerts.build import RUNBOOK_BASE, runbook_url

DATASOURCE = dash_m.DataSourceRef(type_val="prometheus", uid="${datasource}")
RUN = 'run=~"$run"'  # every trainer and sentinel series carries `run` (docs/metrics.md); `run` is a multi-select
RUN_RANK = 'run=~"$run", rank=~"$rank"'  # per-rank series; the All value of `rank` is .* (matches no label too)
RATE = "$__rate_interval"
UIDS = {"training": "sentinel-training", "daemon": "sentinel-daemon"}


# ------------------------------------------------------------------ shared defaults
def query(expr: str, legend: str, ref_id: str, *, per_run: bool = True) -> prometheus.Dataquery:
    # several runs may be selected: every legend names its run (unless the series has no run label)
    legend = f"{{{{run}}}} {legend}" if per_run else legend
    return prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(ref_id).datasource(DATASOURCE)


def increase(counter: str, by: str, legend: str, ref_id: str, sel: str = RUN) -> prometheus.Dataquery:
    """A counter's increase over the panel's rate window, summed by ``by`` (the selected runs only)."""
    return query(f"sum by ({by}) (increase({counter}{{{sel}}}[{RATE}]))", legend, ref_id)


def thresholds(*steps: tuple[float | None, str]) -> dash_b.ThresholdsConfig:
    return (dash_b.ThresholdsConfig().mode(dash_m.ThresholdsMode.ABSOLUTE)
            .steps([dash_m.Threshold(value=v, color=c) for v, c in steps]))


NO_LEVEL = ((None, "green"),)  # a panel whose values have no red-flag level: one base colour


def runbooks(*alerts: str) -> list[dash_b.DashboardLink]:
    """Panel links to the runbook of each alert that reads the panel's series."""
    return [dash_b.DashboardLink(f"Runbook: {a}").type(dash_m.DashboardLinkType.LINK).url(runbook_url(a))
            .target_blank(True) for a in alerts]


def default_timeseries(unit: str, *levels: tuple[float | None, str], alerts: tuple[str, ...] = ()) -> timeseries.Panel:
    """A half-width graph with a unit and thresholds; real levels (beyond the base) are drawn as lines."""
    p = (
        timeseries.Panel()
        .datasource(DATASOURCE)
        .height(8)
        .span(12)
        .unit(unit)
        .line_width(1)
        .fill_opacity(10)
        .show_points(common.VisibilityMode.NEVER)
        .legend(common_b.VizLegendOptions().display_mode(common.LegendDisplayMode.LIST)
                .placement(common.LegendPlacement.BOTTOM).show_legend(True))
        .tooltip(common_b.VizTooltipOptions().mode(common.TooltipDisplayMode.MULTI).sort(common.SortOrder.DESCENDING))
        .thresholds(thresholds(*(levels or NO_LEVEL)))
    )
    if len(levels) > 1:
        p = p.thresholds_style(common_b.GraphThresholdsStyleConfig().mode(common.GraphThresholdsStyleMode.LINE))
    return p.links(runbooks(*alerts)) if alerts else p


def default_stat(unit: str, *levels: tuple[float | None, str], alerts: tuple[str, ...] = (), span: int = 4) -> stat.Panel:
    p = (
        stat.Panel()
        .datasource(DATASOURCE)
        .height(4)
        .span(span)
        .unit(unit)
        .graph_mode(common.BigValueGraphMode.AREA)
        .color_mode(common.BigValueColorMode.BACKGROUND if len(levels) > 1 else common.BigValueColorMode.NONE)
        .reduce_options(common_b.ReduceDataOptions().calcs(["lastNotNull"]))
        .thresholds(thresholds(*(levels or NO_LEVEL)))
    )
    return p.links(runbooks(*alerts)) if alerts else p


def right_axis(ref_id: str, unit: str) -> list[dash_m.DynamicConfigValue]:
    return [dash_m.DynamicConfigValue(id_val="custom.axisPlacement", value="right"),
            dash_m.DynamicConfigValue(id_val="unit", value=unit)]


class _PromAnnotationQuery(dash_m.AnnotationQuery):
    """The SDK's AnnotationQuery lacks the Prometheus annotation fields ``titleFormat`` and
    ``tagKeys``: without them every timeline marker would read just the annotation's name."""

    def __init__(self, title_format: str, tag_keys: str) -> None:
        super().__init__()
        self.title_format, self.tag_keys = title_format, tag_keys

    def to_json(self) -> dict[str, object]:
        return {**super().to_json(), "titleFormat": self.title_format, "tagKeys": self.tag_keys}


def annotation(name: str, expr: str, color: str, *, title: str | None = None, tags: str = "") -> dash_b.AnnotationQuery:
    # A Prometheus annotation: an event wherever the expression has a sample. `changes(...[1m]) > 0`
    # marks the minute in which a counter or timestamp moved, whatever the dashboard's resolution.
    b = dash_b.AnnotationQuery()
    if title is not None:
        b._internal = _PromAnnotationQuery(title, tags)  # noqa: SLF001 (the builder has no hook for these fields)
    return b.name(name).datasource(DATASOURCE).enable(True).icon_color(color).expr(expr)


def run_variable() -> dash_b.QueryVariable:
    return (dash_b.QueryVariable("run").label("run").datasource(DATASOURCE)
            .query("label_values(training_step, run)")
            .multi(True).include_all(True)
            .refresh(dash_m.VariableRefresh.ON_TIME_RANGE_CHANGED)
            .sort(dash_m.VariableSort.ALPHABETICAL_ASC))


def rank_variable() -> dash_b.QueryVariable:
    # All = .*: also matches a series without `rank` (e.g. `up` on Kubernetes, whose targets carry
    # node_rank and local_rank instead)
    return (dash_b.QueryVariable("rank").label("rank").datasource(DATASOURCE)
            .query(f"label_values(training_heartbeat_timestamp_seconds{{{RUN}}}, rank)")
            .multi(True).include_all(True).all_value(".*")
            .refresh(dash_m.VariableRefresh.ON_TIME_RANGE_CHANGED)
            .sort(dash_m.VariableSort.NUMERICAL_ASC))


def datasource_variable() -> dash_b.DatasourceVariable:
    return dash_b.DatasourceVariable("datasource").label("Data source").type("prometheus")


def dashboard_link(title: str, uid: str) -> dash_b.DashboardLink:
    """A link to the other dashboard that keeps the time range and the variables (run, rank)."""
    return (dash_b.DashboardLink(title).type(dash_m.DashboardLinkType.LINK).url(f"/d/{uid}")
            .icon("dashboard").include_vars(True).keep_time(True))


def base_dashboard(title: str, uid: str, description: str, *, rank: bool) -> dash_b.Dashboard:
    other = {UIDS["training"]: ("Sentinel daemon health", UIDS["daemon"]),
             UIDS["daemon"]: ("Training run", UIDS["training"])}[uid]
    d = (
        dash_b.Dashboard(title)
        .uid(uid)
        .description(description)
        .tags(["sentinel", "training"])
        .refresh("30s")
        .time("now-6h", "now")
        .timezone("browser")
        .tooltip(dash_m.DashboardCursorSync.CROSSHAIR)  # one timeline across every panel
        .with_variable(datasource_variable())
        .with_variable(run_variable())
        .link(dashboard_link(*other))
        .link(dash_b.DashboardLink("Runbooks").type(dash_m.DashboardLinkType.LINK).icon("doc")
              .url(f"{RUNBOOK_BASE}/docs/runbooks/").target_blank(True))
    )
    return d.with_variable(rank_variable()) if rank else d
