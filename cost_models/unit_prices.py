"""Each class of units priced once while a search runs, not once per cost table.

A search builds a table per mesh, micro-batch and (pipelined) kind of stage, and most of them price the same
repeated block again on the same profile, mesh and training: a pipelined mesh's first, middle and last stages
each hold it, and so do the stages its schedules cut differently. Pricing one unit's options (its ops' times,
then every option's bytes and seconds: cost_models.option_cost) reads only the unit's op contents (not their
names), its parameters' shapes, whether it is the root or a leaf, what each way of checkpointing keeps of it,
the profile, the mesh, the training and whether offload is offered; `UnitPrices` keys the priced classes on
exactly that and hands every table its own copies (later steps adjust a table's costs in place).

The classes are kept only while a search runs (cost_models.search_memo): outside one every table prices its
units afresh.
"""

from __future__ import annotations

from dataclasses import fields
from operator import attrgetter

from cost_models.choices import Option, options_for
from cost_models.mesh import Mesh
from cost_models.option_cost import OptionCost, UnitPricer
from cost_models.profile import DeviceProfile
from cost_models.records import OpRecord, Unit
from cost_models.search_memo import memo
from cost_models.training import Training

__all__ = ["UnitPrices", "copied", "op_content"]


class UnitPrices:
    """Units' options and their costs on one profile, mesh, training and offload, each class priced once."""

    def __init__(self, profile: DeviceProfile, mesh: Mesh, training: Training, offload: bool):
        self.pricer = UnitPricer(profile, mesh, training, offload)
        self.profile, self.mesh, self.training, self.offload = profile, mesh, training, offload
        self._priced: dict[tuple, tuple[list[Option], list[OptionCost]]] = {}

    @classmethod
    def on(cls, profile: DeviceProfile, mesh: Mesh, training: Training, offload: bool) -> UnitPrices:
        """The running search's prices on these (new ones outside a search)."""
        return memo((cls, id(profile), mesh, training, offload), lambda: cls(profile, mesh, training, offload),
                    held=(profile,))

    def of(self, inputs, index: int, unit_ops: list) -> tuple[list[Option], list[OptionCost]]:
        """The options of `inputs`' (a table.TableInputs) `index`-th unit, whose ops are `unit_ops` (in its order),
        and what each costs: the caller's own copies."""
        unit: Unit = inputs.units[index]
        modes = sorted(inputs.keep)
        contents = tuple(map(_content, unit_ops))
        key = (unit.is_root, unit.is_leaf, tuple(p.shape for p in unit.params), contents,
               tuple((mode, inputs.keep[mode][index], inputs.backward_keep[mode][index]) for mode in modes))
        priced = self._priced.get(key)
        if priced is None:
            priced = self._priced[key] = self._price(inputs, index, unit_ops, contents)
        return list(priced[0]), [copied(cost) for cost in priced[1]]

    def _price(self, inputs, index: int, unit_ops: list, contents: tuple) -> tuple[list[Option], list[OptionCost]]:
        unit, pricer = inputs.units[index], self.pricer
        options = [option for option in options_for(unit.is_leaf, unit.is_root, self.mesh.nodes, self.offload,
                                                     bool(unit.params))
                   if not option.mode.checkpoints or option.recompute in inputs.keep]  # modes the inputs price
        # its compute reads the ops, the profile and the compute dtype, not the mesh: shared by every mesh's tables
        times = memo(("unit times", id(self.profile), self.training.dtype, contents),
                     lambda: pricer.unit_times(unit_ops), held=(self.profile,))
        return options, [pricer.option_cost(unit, option, times, inputs.keep, inputs.backward_keep, index)
                         for option in options]


def copied(cost: OptionCost) -> OptionCost:
    """A shallow copy (copy.copy is 10x slower on a dataclass: a 3000-layer table copies 54,000)."""
    new = object.__new__(type(cost))
    new.__dict__.update(cost.__dict__)
    return new


# what an op's costs read: all of it but its name and module path (which differ between a model's repeated blocks)
_OP_CONTENT = tuple(f.name for f in fields(OpRecord) if f.name not in ("name", "module"))
_content = attrgetter(*_OP_CONTENT)


def op_content(op: OpRecord) -> tuple:
    """Everything of an op that its costs read."""
    return _content(op)
