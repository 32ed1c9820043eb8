"""User pins: module-path patterns with the decisions an engineer fixes; the solver completes the rest.

A pin is `PATTERN: DECISION`. A pattern is a module path whose components may be `*` (any one
component), `**` (any number of components, none included), an integer range or list (`0-11`,
`0-3,8`) or a glob within a component (`h*`); `<root>` is the root module, which no wildcard
matches. A decision fixes any subset of a unit's fields (sharding, checkpoint, offload):

- an option's label, as plans and reports write it, fixes all three: `shard`, `shard+ckpt`,
  `replicate+sel+offload` (no checkpoint mode: none; no `+offload`: not offloaded);
- without a sharding kind it fixes what it names: `ckpt`, `sel+offload`, `checkpoint=full`,
  `sharding=shard,offload=false`;
- a mapping fixes its keys: `{sharding: shard, checkpoint: full, offload: true}`.

Pins come from a pins file (YAML or JSON, `pins:` mapping patterns to decisions; unknown keys
refused) and from `--pin PATTERN=DECISION` (API: `pin=[...]`). This module parses, matches and
writes them; it imports no torch: which units a pattern names, and whether a decision is an option
there, is decided where the units are known (autoplan.solve.pins).
"""

from autoplan.pins.files import (
    PinSet,
    PinsInfeasibleError,
    load_pins,
    path_groups,
    pins_of_plan,
    pins_of_units,
    range_text,
)
from autoplan.pins.syntax import FIELDS, ROOT, Decision, Pattern, Pin, parse_decision, parse_pin

__all__ = [
    "Decision", "FIELDS", "Pattern", "Pin", "PinSet", "PinsInfeasibleError", "ROOT", "load_pins", "parse_decision",
    "parse_pin", "path_groups", "pins_of_plan", "pins_of_units", "range_text",
]
