"""``einshard analyze``: print the plan of one annotated einsum (what :func:`einshard.analyze` returns).

    einshard analyze 'b x@data, x y@model -> b? y?' --mesh data=4,model=2 \\
        --sizes b=1024,x=4096,y=16384 --dtype bf16 --profile h100

Uses ``rich`` for the tables when it is installed (the ``cli`` extra), plain
text otherwise (or with ``--plain``); ``--json`` prints ``plan.to_dict()``.
"""

from __future__ import annotations

import argparse
import json
import sys

from einshard._src.analysis.cost import human_bytes, human_time
from einshard._src.analysis.einsum.plan import (
    COLLECTIVE_COLUMNS,
    collective_rows,
    format_plan,
    side_string,
    type_string,
)
from einshard.analysis import EinsumPlan, analyze
from einshard.errors import EinshardError

__all__ = ["run", "parse_pairs"]


def parse_pairs(text: str, what: str) -> dict[str, int]:
    """``'data=4,model=2'`` → ``{'data': 4, 'model': 2}`` (EinshardError on anything else)."""
    out: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, eq, value = part.partition("=")
        value = value.strip()
        # isdigit() alone accepts '²' and thousands of digits: sizes are ASCII, at most 18 digits (< 10**18).
        if not eq or not name.strip() or not (value.isascii() and value.isdigit() and len(value) <= 18):
            raise EinshardError(f"--{what}: expected name=size pairs separated by commas, got {part!r} in {text!r}")
        if name.strip() in out:
            raise EinshardError(f"--{what} gives {name.strip()!r} twice: {text!r}")
        out[name.strip()] = int(value)
    return out


def _check_flags(text: str, mesh: dict[str, int], sizes: dict[str, int]) -> None:
    """Every mesh axis the einsum names is in --mesh and every einsum axis in --sizes; errors name the flags."""
    from einshard._src.parsing import parse_einsum

    expr = parse_einsum(text)
    for side in expr.sides:
        for item in side.axes:
            # With a --mesh, an axis it lacks is the library's error (it suggests the near miss: 'modle' -> 'model').
            missing = [m for m in item.mesh_axes or () if not mesh]
            if missing:
                example = ",".join([*(f"{k}={v}" for k, v in mesh.items()), *(f"{m}=2" for m in missing)])
                raise expr.fail(
                    f"mesh axis {missing[0]!r} (axis {item.name!r}) has no size: "
                    + (f"--mesh gives only {', '.join(mesh)}" if mesh else "there is no --mesh"),
                    item.column,
                    f"Give every mesh axis a size: --mesh {example}",
                )
    names = list(dict.fromkeys(n for side in expr.inputs for n in side.names))
    unsized = [n for n in names if n not in sizes]
    if unsized:
        example = ",".join([*(f"{k}={v}" for k, v in sizes.items() if k in names), *(f"{n}=N" for n in unsized)])
        raise expr.fail(
            f"no size for axis {', '.join(repr(n) for n in unsized)}",
            None,
            f"Give every einsum axis a size: --sizes {example}",
        )


def run(args: argparse.Namespace) -> int:
    mesh, sizes = parse_pairs(args.mesh, "mesh"), parse_pairs(args.sizes, "sizes")
    _check_flags(args.expression, mesh, sizes)
    try:
        plan = analyze(args.expression, mesh=mesh, sizes=sizes, dtype=args.dtype, profile=args.profile)
    except EinshardError as err:
        if err.hint and "Pass mesh=" in err.hint:  # the library's hint names its argument: name the flag
            before = err.hint[: err.hint.index("Pass mesh=")]
            if before:  # 'Did you mean ...?': the fix is the expression's spelling, not a new axis
                hint = before + "The mesh axes are --mesh's: " + ", ".join(mesh)
            else:
                from einshard._src.parsing import parse_einsum

                named = [
                    m for side in parse_einsum(args.expression).sides for i in side.axes for m in i.mesh_axes or ()
                ]
                pairs = [f"{k}={v}" for k, v in mesh.items()] + [
                    f"{m}=N" for m in dict.fromkeys(named) if m not in mesh
                ]
                hint = "Give every mesh axis the expression names a size: --mesh " + ",".join(pairs)
            raise EinshardError(err.reason, err.expression, err.column, hint) from None
        raise
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2, ensure_ascii=False))
        return 0
    if not args.plain:
        try:
            import rich  # noqa: F401
        except ImportError:
            pass
        else:
            _print_rich(plan, args.alternatives)
            return 0
    print(format_plan(plan, max_alternatives=args.alternatives))
    return 0


def _print_rich(plan: EinsumPlan, max_alternatives: int) -> None:
    import shutil

    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    # Piped output gets a wide console: rich would wrap every table at 80 columns.
    width = shutil.get_terminal_size().columns if sys.stdout.isatty() else 220
    console = Console(file=sys.stdout, width=width)
    mesh = " ".join(str(m) for m in plan.mesh) or "(none)"
    console.print(f"[bold]{escape(plan.expression)}[/bold]")
    console.print(f"mesh {mesh} ({plan.devices} devices), {plan.dtype}, profile {plan.profile.name}")
    roles = "; ".join(f"{m}: {r}" for m, r in plan.roles.items())
    console.print(
        f"strategy [bold green]{escape(plan.strategy)}[/bold green]"
        + (f" ({escape(roles)})" if roles else "")
        + f"  [dim]tutorial view: {plan.tutorial_view}[/dim]"
    )
    console.print(escape("axes " + ", ".join(f"{e} {c}" for e, c in plan.classes.items())))

    tensors = Table(show_edge=False, header_style="bold")
    for col in ("tensor", "axes", "type", "per device", "computed as"):
        tensors.add_column(col)
    for i, (op, used) in enumerate(zip(plan.operands, plan.operands_used, strict=True)):
        tensors.add_row(
            f"operand {i + 1}" + (" (weight)" if plan.weight == i else ""),
            escape(side_string(op)),
            escape(type_string(op, plan.dtype)),
            human_bytes(op.bytes_per_device(plan.itemsize)),
            "" if used == op else escape(type_string(used, plan.dtype)),
        )
    tensors.add_row(
        "result",
        escape(side_string(plan.out_layout)),
        escape(type_string(plan.out_layout, plan.dtype)),
        human_bytes(plan.out_bytes),
        "" if plan.computed_layout == plan.out_layout else escape(type_string(plan.computed_layout, plan.dtype)),
    )
    console.print(tensors)

    if plan.collectives:
        comm = Table(show_edge=False, header_style="bold")
        for col in COLLECTIVE_COLUMNS:
            comm.add_column(col)
        for row in collective_rows(plan):
            comm.add_row(*(escape(cell) for cell in row))
        console.print(comm)
    else:
        console.print("[green]no communication[/green]")
    console.print(
        f"per device: {plan.flops:.4g} FLOPs ({human_time(plan.compute_time)}), sends {human_bytes(plan.comm_bytes)} "
        f"({human_time(plan.comm_time)}); estimated [bold]{human_time(plan.time)}[/bold]"
    )
    console.print(f"why: {escape(plan.why)}")
    if plan.alternatives and max_alternatives > 0:
        alts = Table(title="alternatives (cheapest first)", show_edge=False, header_style="bold")
        for col in ("", "time", "result", "collectives", "why"):
            alts.add_column(col)
        for k, alt in enumerate(plan.alternatives[:max_alternatives], 1):
            collectives = ", ".join(f"{c.kind}@{','.join(c.axes)}({c.tensor})" for c in alt.collectives) or "none"
            alts.add_row(
                f"{k}.",
                human_time(alt.time),
                escape(type_string(alt.out_layout, alt.dtype)),
                collectives,
                escape(alt.why),
            )
        console.print(alts)
        if len(plan.alternatives) > max_alternatives:
            console.print(f"... {len(plan.alternatives) - max_alternatives} more (--alternatives N)")
