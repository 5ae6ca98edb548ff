"""The verl key table: every rule of :mod:`rlplat_verl.training_keys`, :mod:`rlplat_verl.rollout_keys`,
:mod:`rlplat_verl.run_keys` and :mod:`rlplat_verl.distillation_keys`, in that order, as :data:`RULES`;
:func:`find_rule` looks a key up, and :func:`markdown_table` writes the table ``docs/coming-from-verl.md`` holds
(``python -m rlplat_verl.table``).
"""

from __future__ import annotations

from rlplat_verl import rollout_keys, run_keys, training_keys  # noqa: F401  (each adds its rules on import)
from rlplat_verl import distillation_keys  # noqa: F401,I001  (after the others: its rules close the table)
from rlplat_verl.rules import RULES_BUILT, Rule

TABLE_START, TABLE_END = "<!-- verl-keys-table:start -->", "<!-- verl-keys-table:end -->"

RULES: tuple[Rule, ...] = tuple(RULES_BUILT)
EXACT = {rule.key: rule for rule in RULES if not rule.key.endswith(".*")}
PREFIXES = sorted((rule for rule in RULES if rule.key.endswith(".*")), key=lambda rule: -len(rule.key))


def find_rule(key: str) -> Rule | None:
    """The rule of ``key``: its own, else the longest node rule above it."""
    if key in EXACT:
        return EXACT[key]
    return next((rule for rule in PREFIXES if key.startswith(rule.key[:-1])), None)



def markdown_table() -> str:
    """The rules as a Markdown table: verl key, rlplat key(s), how."""
    lines = ["| verl key | rlplat key | how |", "| --- | --- | --- |"]
    for rule in RULES:
        targets = ", ".join(str(target) for target in rule.targets) or "—"
        lines.append(f"| `{rule.key}` | {targets} | {rule.summary.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
