"""A pipeline's plan: its file (the format is described at the top of lingua/jobs/pipeline.py) read into stages, each
expanded per variant with its values filled in, checked, and ordered after the stages it needs. Reading a plan runs
nothing and touches no record.
"""

import dataclasses
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lingua.args import read_yaml
from lingua.errors import UserError

NAME = re.compile(r"[A-Za-z0-9_-]+")  # a stage's or a variant's: in a folder's name and a job's


@dataclass
class Stage:
    name: str  # STAGE, or STAGE.VARIANT
    module: str
    args: list[str]
    after: list[str]  # the names of the stages it needs
    launcher: dict[str, Any] = field(default_factory=dict)

    def command(self) -> list[str]:
        return [sys.executable, "-m", self.module, *self.args]

    @property
    def line(self) -> str:
        """What the stage runs, as its records name it: a stage whose line changed is another stage."""
        return shlex.join([self.module, *self.args])


@dataclass
class Pipeline:
    dump_dir: Path
    stages: list[Stage]  # in an order where every stage comes after those it needs
    variants: dict[str, dict[str, Any]]
    paths: dict[str, str]
    source: str

    def record(self) -> dict[str, Any]:
        return {"source": self.source, "dump_dir": str(self.dump_dir), "paths": self.paths, "variants": self.variants,
                "stages": [dataclasses.asdict(stage) for stage in self.stages]}



def load_pipeline(path: str, paths: dict[str, str] | None = None) -> Pipeline:
    """The pipeline of a file, its stages expanded per variant, checked, and ordered by their dependencies."""
    spec = read_yaml(path)
    unknown = sorted(set(spec) - {"dump_dir", "paths", "variants", "launcher", "stages"})
    if unknown:
        raise UserError(f"pipeline {path}: unknown key '{unknown[0]}'")
    if not spec.get("dump_dir") or not isinstance(spec.get("stages"), dict) or not spec["stages"]:
        raise UserError(f"pipeline {path} needs a dump_dir and stages (a mapping of stage names to stages)")
    if not all(isinstance(v, dict) for v in (spec.get("variants") or {}).values()):
        raise UserError(f"pipeline {path}: variants must map each variant's name to its keys ({{app: bert}})")
    given = {**(spec.get("paths") or {}), **(paths or {})}
    extra = sorted(set(paths or {}) - set(spec.get("paths") or {}) - {"dump_dir"})
    if extra:
        raise UserError(f"pipeline {path} has no path '{extra[0]}' (its paths: "
                        f"{', '.join(['dump_dir', *(spec.get('paths') or {})])})")
    resolved = {name: str(Path(str(value)).expanduser().resolve()) for name, value in given.items()}
    dump_dir = Path(resolved.pop("dump_dir", spec["dump_dir"])).expanduser().resolve()
    variants = spec.get("variants") or {}
    bad = [(what, name) for what, names in (("stage", spec["stages"]), ("variant", variants)) for name in names
           if not (isinstance(name, str) and NAME.fullmatch(name))]
    if bad:
        raise UserError(f"pipeline {path}: {bad[0][0]} {bad[0][1]!r} is not a name (letters, digits, _ and -)")
    stages = _expand(path, spec["stages"], variants, {**resolved, "dir": str(dump_dir)}, spec.get("launcher") or {})
    return Pipeline(dump_dir, _ordered(path, stages), variants, resolved, str(Path(path).resolve()))


def _expand(path: str, specs: dict, variants: dict, names: dict[str, str], launcher: dict) -> list[Stage]:
    keys = {"variant", *(key for fields in variants.values() for key in fields)}
    per_variant = {name for name, s in specs.items()
                   if any(f"{{{key}}}" in str((s or {}).get("run", "")) for key in keys)}
    stages = []
    for name, stage_spec in specs.items():
        stage_spec = stage_spec or {}
        unknown = sorted(set(stage_spec) - {"run", "after", "launcher"})
        if unknown or not stage_spec.get("run"):
            raise UserError(f"pipeline {path}: stage {name} " + (f"has an unknown key '{unknown[0]}'" if unknown
                                                                   else "has no run (a module and its arguments)"))
        after = stage_spec.get("after") or []
        if not isinstance(after, list) or not all(isinstance(need, str) for need in after):
            raise UserError(f"pipeline {path}: stage {name}'s after must be a list of stage names")
        missing = [need for need in after if need.split(".")[0] not in specs]
        if missing:
            raise UserError(f"pipeline {path}: stage {name} comes after '{missing[0]}', which is not a stage")
        for variant in (variants if name in per_variant else [""]):
            values = {**names, **({"variant": variant, **variants[variant]} if variant else {})}
            try:
                module, *args = [word.format_map(values) for word in shlex.split(str(stage_spec["run"]))]
                launch = {key: value.format_map(values) if isinstance(value, str) else value
                          for key, value in {**launcher, **(stage_spec.get("launcher") or {})}.items()}
            except KeyError as e:
                where = f"variant {variant}" if variant else "the pipeline's paths"
                raise UserError(f"pipeline {path}: stage {name} uses {{{e.args[0]}}}, which {where} does not "
                                "define") from None
            except (ValueError, IndexError) as e:  # a lone brace, {0}, an unclosed quote
                raise UserError(f"pipeline {path}: stage {name}'s run cannot be read ({e}); a literal brace is "
                                "written {{ or }}") from None
            needs = _needs(after, variant, per_variant, variants)
            stages.append(Stage(f"{name}.{variant}" if variant else name, module, args, needs, launch))
    return stages


def _needs(after: list[str], variant: str, per_variant: set[str], variants: dict) -> list[str]:
    """The stages named by `after`: a per-variant stage is the same variant's, or every variant's from a stage
    run once; STAGE.VARIANT names one."""
    needs = []
    for need in after:
        if "." in need or need not in per_variant:
            needs.append(need)
        else:
            needs += [f"{need}.{variant}"] if variant else [f"{need}.{v}" for v in variants]
    return needs


def _ordered(path: str, stages: list[Stage]) -> list[Stage]:
    """The stages in the file's order, each moved after the stages it needs; a cycle is refused."""
    by_name = {stage.name: stage for stage in stages}
    unknown = [(s.name, need) for s in stages for need in s.after if need not in by_name]
    if unknown:
        raise UserError(f"pipeline {path}: stage {unknown[0][0]} comes after {unknown[0][1]}, which is not a stage")
    ordered: list[Stage] = []
    visiting: set[str] = set()

    def visit(stage: Stage) -> None:
        if stage in ordered:
            return
        if stage.name in visiting:
            raise UserError(f"pipeline {path}: stage {stage.name} depends on itself (through its after)")
        visiting.add(stage.name)
        for need in stage.after:
            visit(by_name[need])
        ordered.append(stage)

    for stage in stages:
        visit(stage)
    return ordered
