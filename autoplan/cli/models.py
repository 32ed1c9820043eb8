"""`autoplan models`: the model zoo with parameter counts.

The counts come from the configs (`ModelConfig.n_params`), not from building the modules: building 13
models on the meta device imports torch and initialises every layer (seconds), for numbers that the
shapes give exactly. tests/test_models.py checks each count against the built model.
"""

from __future__ import annotations

__all__ = ["register"]


def register(subparsers) -> None:
    parser = subparsers.add_parser("models", help="list the model zoo with parameter counts")
    parser.set_defaults(handler=_run, subparser=parser)


def _run(args) -> int:
    from autoplan.models.config import ALIASES, FAMILY_FOLLOWS, PRESETS

    aliases: dict[str, list[str]] = {}
    for alias, target in ALIASES.items():
        aliases.setdefault(target, []).append(alias)
    print(f"{'name':<16} {'parameters':>18}  aliases")
    for name, config in PRESETS.items():
        print(f"{name:<16} {config.n_params:>18,}  {', '.join(aliases.get(name, []))}")
    print("\nwhat each family saves for backward:")
    for family in dict.fromkeys(config.family for config in PRESETS.values()):
        print(f"  {family}: {FAMILY_FOLLOWS[family]}")
    print("\nor a factory of your own: --model package.module:factory (returns an nn.Module)")
    return 0
