"""The pin flags search and estimate share: a repeatable `--pin`, and writing a plan's decisions as pins.

`--pin` is the settings field `pin` (a list), which the generated flags cannot express (they are one
value each); its help is still the field's docstring.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from autoplan.cli.flags import to_flags

__all__ = ["add_pin_flag", "emit_pins"]


def add_pin_flag(parser: argparse.ArgumentParser, settings_cls) -> None:
    info = settings_cls.model_fields["pin"]
    parser.add_argument("--pin", dest="pin", action="append", default=argparse.SUPPRESS, metavar="PATTERN=DECISION",
                        help=to_flags(" ".join((info.description or "").split()).replace("%", "%%"), parser))


def emit_pins(plan, path: str, plan_file: str) -> None:
    """Write `plan`'s decisions as a pins file that reproduces them (YAML, or JSON for *.json)."""
    from autoplan.fileio import write_text_atomic
    from autoplan.pins import pins_of_plan
    from autoplan.sizes import format_bytes

    pins = pins_of_plan(plan)
    t, c = plan.training, plan.cluster
    header = (f"autoplan pins: the decisions of {plan_file} ({plan.model.name}, {c.world_size} GPUs, limit "
              f"{format_bytes(c.mem_limit_bytes)}, micro-batch {t.micro_batch_size} x {t.grad_accum_steps}).\n"
              "Each line fixes the units its pattern names (`*` one path component, `**` any depth, 0-11 a range);\n"
              "delete a line to let the solver choose there, edit one to force a choice, then:\n"
              "  autoplan search ... --pins THIS_FILE")
    write_text_atomic(path, pins.dump(json_format=Path(path).suffix.lower() == ".json", header=header))
