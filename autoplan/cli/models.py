"""`autoplan models`: the model zoo with parameter counts."""

from __future__ import annotations

__all__ = ["register"]


def register(subparsers) -> None:
    parser = subparsers.add_parser("models", help="list the model zoo with parameter counts")
    parser.set_defaults(handler=_run, subparser=parser)


def _run(args) -> int:
    from autoplan.models.zoo import ALIASES, PRESETS, build_model, count_params

    aliases: dict[str, list[str]] = {}
    for alias, target in ALIASES.items():
        aliases.setdefault(target, []).append(alias)
    print(f"{'name':<16} {'parameters':>18}  aliases")
    follows: dict[str, str] = {}  # model class -> the implementation whose saved activations it matches
    for name in PRESETS:
        model = build_model(name, device="meta")
        follows.setdefault(type(model).__name__, getattr(model, "follows", ""))
        print(f"{name:<16} {count_params(model):>18,}  {', '.join(aliases.get(name, []))}")
    print("\nwhat each family saves for backward:")
    for family, implementation in follows.items():
        if implementation:
            print(f"  {family}: {implementation}")
    print("\nor a factory of your own: --model package.module:factory (returns an nn.Module)")
    return 0
