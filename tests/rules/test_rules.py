"""Rules files: defaults, validation, and one-line errors that name the file and the field."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from sentinel.cli.rules_cmd import rules as rules_group
from sentinel.rules import DEFAULT_RULES_PATH, RulesError, RuleSet, default_rules, parse_rules
from sentinel.rules_file import load_rules


def write(tmp_path: Path, text: str, name: str = "rules.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_default_file_equals_schema_defaults():
    """The YAML the daemon reads and the pydantic defaults must never drift apart."""
    assert default_rules() == RuleSet()
    assert DEFAULT_RULES_PATH.is_file()


def test_parsed_rules_text_is_remembered_but_never_shared():
    """The YAML of a rules text is parsed once per process; each call still gets its own RuleSet,
    so changing one (the CLI and tests do) cannot change the next."""
    a, b = default_rules(), default_rules()
    assert a == b and a is not b
    a.rules.loss_spike.threshold = 9.0
    a.rules.slice_regression.fields.append("probe_loss")
    assert default_rules() == b and default_rules().rules.loss_spike.threshold == b.rules.loss_spike.threshold != 9.0
    assert default_rules().rules.slice_regression.fields == ["val_slice_loss", "probe_loss"]
    text = "rules:\n  loss_spike: {threshold: 7.0}\n"
    assert parse_rules(text) == parse_rules(text) and parse_rules(text).rules.loss_spike.threshold == 7.0


def test_partial_file_inherits_defaults(tmp_path):
    rs = load_rules(write(tmp_path, "rules:\n  loss_spike:\n    threshold: 7.5\npolicy:\n  max_rollbacks_per_hour: 5\n"))
    assert rs.rules.loss_spike.threshold == 7.5
    assert rs.rules.loss_spike.window == RuleSet().rules.loss_spike.window
    assert rs.policy.max_rollbacks_per_hour == 5


def test_a_partial_section_keeps_the_shipped_value_of_every_key_it_leaves_out():
    """default_rules.yaml says "any key left out takes the value shown here": for every rule
    section, a file that names only one key of it gets the shipped file's values for the others
    (mfu_low's severity used to fall back to BandRule's own "warning", not the shipped "info")."""
    shipped = default_rules()
    for name, section in shipped.rules.items():
        rs = parse_rules(f"rules:\n  {name}:\n    enabled: {str(section.enabled).lower()}\n")
        assert getattr(rs.rules, name) == section, name
    assert parse_rules("rules:\n  mfu_low:\n    min_fraction: 0.5\n").rules.mfu_low.severity == "info"
    assert RuleSet() == shipped  # the classes' defaults and the shipped file agree everywhere


def test_model_validate_directly():
    rs = RuleSet.model_validate({"rules": {"divergence": {"k": 4, "n": 8}}})
    assert (rs.rules.divergence.k, rs.rules.divergence.n) == (4, 8)


@pytest.mark.parametrize(
    "text,expected",
    [
        ("rules:\n  loss_spike:\n    threshold: abc\n", "rules.yaml: rules.loss_spike.threshold: expected a number"),
        ("rules:\n  loss_spike:\n    thresold: 5\n", "rules.yaml: rules.loss_spike.thresold: unknown key"),
        ("rules:\n  no_such_rule: {}\n", "rules.yaml: rules.no_such_rule: unknown key"),
        ("policy:\n  max_rollbacks_per_hour: -1\n", "rules.yaml: policy.max_rollbacks_per_hour: Input should be greater than or equal to 0"),
        ("rules:\n  heartbeat_stale:\n    severity: loud\n", "rules.yaml: rules.heartbeat_stale.severity: Input should be 'info', 'warning' or 'critical'"),
        ("- just\n- a list\n", "rules.yaml: <root>: expected a mapping"),
        ("rules:\n  divergence:\n    climb_long_window: 2\n", "rules.yaml: rules.divergence.climb_long_window: must be 0 (off) or at least 4"),
    ],
)
def test_validation_errors_are_one_line_with_file_and_path(tmp_path, text, expected):
    with pytest.raises(RulesError) as ei:
        load_rules(write(tmp_path, text))
    msg = str(ei.value)
    assert "\n" not in msg
    assert msg.replace(str(tmp_path) + "/", "").startswith(expected)


def test_yaml_syntax_error_names_line_and_column(tmp_path):
    with pytest.raises(RulesError) as ei:
        load_rules(write(tmp_path, "rules:\n  loss_spike:\n    threshold: [1, 2\n"))
    msg = str(ei.value)
    assert "\n" not in msg and "rules.yaml: line " in msg and "column" in msg


def test_empty_text_is_the_defaults_but_an_empty_file_is_refused(tmp_path):
    assert parse_rules("") == RuleSet()  # an embedded/empty document: every default
    with pytest.raises(RulesError, match="rules file is empty"):
        load_rules(write(tmp_path, "# nothing yet\n"))  # a file: a truncated copy or a wrong path


def test_cli_check_ok_and_json(tmp_path):
    r = CliRunner().invoke(rules_group, ["check", str(DEFAULT_RULES_PATH)])
    assert r.exit_code == 0, r.output
    assert "loss_spike" in r.output
    r = CliRunner().invoke(rules_group, ["check", str(DEFAULT_RULES_PATH), "--json"])
    import json

    data = json.loads(r.output)
    assert data["ok"] is True and data["rules"]["loss_spike"]["threshold"] == 6.0


def test_cli_check_bad_file_exit_2_one_line(tmp_path):
    p = write(tmp_path, "rules:\n  loss_spike:\n    threshold: abc\n")
    r = CliRunner().invoke(rules_group, ["check", str(p)])
    assert r.exit_code == 2
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "rules.loss_spike.threshold" in lines[0]
    r = CliRunner().invoke(rules_group, ["check", str(tmp_path / "missing.yaml")])
    assert r.exit_code == 2 and r.output.strip().startswith("error: ") and len(r.output.strip().splitlines()) == 1


@pytest.mark.parametrize("text, said", [
    # before: a ValueError traceback (Python refuses to convert 4,300+ digits)
    ("rules:\n  loss_spike:\n    window: " + "9" * 5000 + "\n", "a value no setting can hold"),
    ("policy:\n  rollback_margin_steps: " + "9" * 5000 + "\n", "a value no setting can hold"),
    # before: "valid", and the rule (with every divergence test that waits on its warmup) never judged
    ("rules:\n  loss_spike:\n    window: 8\n    min_history: 100000\n", "min_history = 100000 is more than window = 8"),
    ("rules:\n  grad_norm_spike:\n    window: 16\n    min_history: 17\n", "min_history = 17 is more than window = 16"),
    ("rules:\n  throughput_low:\n    window: 8\n    min_history: 9\n", "min_history = 9 is more than window = 8"),
    # YAML 1.1 reads 1:30 as 90 (base 60): before, the window silently became 90
    ("rules:\n  loss_spike:\n    window: 1:30\n", "'1:30' is read as a base-60 number"),
    # a wrong file (credentials, another tool's config): before, its first key was echoed
    ("root:$6$s3cr3thash: 20228\nbin: 1\n", "not a rules file: none of policy, rules, version at its top (2 other key(s))"),
])
def test_a_rules_file_that_could_never_work_is_refused_in_one_line(tmp_path, text, said):
    r = CliRunner().invoke(rules_group, ["check", str(write(tmp_path, text))])
    lines = r.output.strip().splitlines()
    assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and said in lines[0], r.output
    assert "s3cr3t" not in r.output


def _val_trace(losses_and_vals):
    from sentinel.protocol import StepRecord

    for step, (loss, val) in enumerate(losses_and_vals, start=1):
        yield StepRecord(run="r", step=step, loss=loss, loss_max_rank=loss, grad_norm=1.0, lr=1e-3, tokens=step,
                         batch_fingerprint="f", time=float(step), val_loss=val)


def _val_findings(points):
    from sentinel.rules import RuleEngine

    eng = RuleEngine(default_rules())
    return [f for rec in _val_trace(points) for f in eng.evaluate(rec) if f.rule == "val_divergence"]


def test_val_divergence_ignores_the_lag_of_a_fast_early_descent():
    # loss falls fast, exponentially (5.5 -> 3.0, time constant 60 steps, like real curves); val (every
    # 50) tracks the *current* loss, so early on it sits far below any lagging train level. That early
    # gap must not become the baseline the rule later pages against.
    import math

    pts = []
    for s in range(1, 601):
        loss = 3.0 + 2.5 * math.exp(-s / 60)
        pts.append((loss, loss - 0.02 if s % 50 == 0 else None))
    assert _val_findings(pts) == []


def test_val_divergence_fires_when_val_pulls_away_from_train():
    pts = []
    for s in range(1, 601):
        val = None
        if s % 50 == 0:
            val = 3.0 + (0.0 if s <= 300 else 0.4)  # overfitting: train flat at 3.0, val jumps +0.4 nats
        pts.append((3.0, val))
    found = _val_findings(pts)
    assert found and found[0].step == 400  # second consecutive eval above best gap + 0.1
