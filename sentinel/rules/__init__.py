"""The rules file and the rule engine.

A ``RuleSet`` is the validated content of a rules YAML file: one section per built-in rule (each
with ``severity``, ``action`` and cooldowns) plus the ``policy`` knobs of the incident state machine.
``default_rules()`` reads ``sentinel/default_rules.yaml``, the file the daemon uses when none is
given; the pydantic defaults (``config``) equal it (a test keeps them in step), so a partial rules
file means "the defaults, except ...".

``RuleEngine`` turns a RuleSet into detectors and evaluates them: ``evaluate(record)`` on every
step, ``evaluate_tick(...)`` on a clock tick (a hung trainer writes no records, so hang detection
cannot wait for one). It returns ``Finding`` objects and decides nothing: cooldowns, incidents and
actions are the policy's job.

Rules whose inputs are absent from a record stay silent: a trace with only ``step`` and ``loss``
evaluates the loss rules and nothing else. ``grad_norm == 0`` counts as "not reported" (the field is
required by the protocol, and a true zero norm carries no spike information either).

Modules: ``config`` (the file's schema and parsing it; reading an operator's file is the edge's
job, ``sentinel.rules_file.load_rules``), ``base`` (``Finding``, the ``Evaluator``
base), one module per family of evaluators (``loss``, ``telemetry``, ``slices``), ``engine``.
"""

from sentinel.rules.base import Finding
from sentinel.rules.config import DEFAULT_RULES_PATH, RulesError, RuleSet, default_rules, parse_rules, rules_yaml
from sentinel.rules.engine import RuleEngine

__all__ = ["DEFAULT_RULES_PATH", "Finding", "RuleEngine", "RuleSet", "RulesError", "default_rules", "parse_rules", "rules_yaml"]
