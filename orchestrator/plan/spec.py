"""The job spec: what a user writes in ``job.yaml``, as one validated object (``JobSpec``).

``JobSpec`` joins the sections (``plan/sections.py``: resources, trainer, command, checkpoint,
budget, teardown, recovery) and checks them against each other; the rest of this module loads a
job file with messages that name the field and the YAML line (:func:`load_spec`,
:func:`parse_spec`), anchors its relative paths, writes it back (:func:`spec_to_yaml`) and
describes it (:func:`json_schema`). Both the orchestrator and the trainer read this module; it
imports nothing heavy.
"""

from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError, field_validator, model_validator

from orchestrator.contract.errors import SpecError
from orchestrator.plan.sections import (
    Budget, Checkpoint, Command, Parallel, Recovery, Resources, Teardown, Trainer, _Model,
)

# Importable from here for callers that name this module (tests/orchestrator/test_startup_and_images.py,
# tests/infra/test_usercode.py). New code imports them from plan/sections.py.
from orchestrator.plan.sections import DEFAULT_LOSS_PATTERN, DEFAULT_NODE_IMAGE, DEFAULT_STEP_PATTERN  # noqa: F401

_NAME_RE = re.compile(r"^[a-z][a-z0-9-]{0,38}[a-z0-9]$")


class JobSpec(_Model):
    """A dtrun job: ``dtrun up job.yaml``."""

    name: str
    """Job name: lowercase letters, digits and dashes (2–40 chars). Provider instances carry it."""
    resources: Resources = Field(default_factory=Resources)
    trainer: Trainer | None = None
    """The bundled trainer. Give ``trainer`` or ``command``, not both."""
    command: Command | None = None
    """Your own training code (a script under torchrun, or any command) instead of the bundled trainer."""
    checkpoint: Checkpoint = Field(default_factory=Checkpoint)
    budget: Budget = Field(default_factory=Budget)
    teardown: Teardown = Field(default_factory=Teardown)
    recovery: Recovery = Field(default_factory=Recovery)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _NAME_RE.match(v):
            raise ValueError("must be 2–40 lowercase letters, digits or dashes, starting with a letter")
        return v

    @model_validator(mode="after")
    def _cross(self) -> "JobSpec":
        r, t = self.resources, self.trainer
        if r.gpu == "cpu" and any(p not in ("local", "fake") for p in r.providers):
            raise ValueError("resources.gpu: cpu runs only on the local or fake provider")
        if r.gpu != "cpu" and r.providers == ["local"]:
            raise ValueError(f"resources.gpu: the local provider runs CPU ranks only; use gpu: cpu")
        if (t is None) == (self.command is None):
            raise ValueError("give trainer (the bundled trainer) or command (your own code), not both"
                             if t is not None else "give a trainer section (the bundled trainer) or a "
                             "command section (your own code)")
        if t is None:
            return self
        n = r.total_gpus
        if isinstance(t.parallel, Parallel):
            p = t.parallel
            if p.pp * p.cp > 1:
                if n % (p.pp * p.cp):
                    raise ValueError(f"trainer.parallel: pp ({p.pp}) × cp ({p.cp}) must divide the job's GPUs "
                                     f"({r.nodes} nodes × {r.gpus_per_node} = {n})")
                if p.cp > 1 and t.seq_len % (2 * p.cp):
                    raise ValueError(f"trainer.parallel.cp ({p.cp}): trainer.seq_len ({t.seq_len}) must be "
                                     f"divisible by 2 × cp = {2 * p.cp} (head-tail balanced sequence shards)")
                n //= p.pp * p.cp  # the rest of the checks are per pipeline stage and context group
                # pp (trainer/pipeline.py) and cp (trainer/context.py) run, also together; cp with ep
                # does not: refused here, before anything is rented (the trainer refuses it too,
                # exit 2) — a dry run must not quote a layout the node would reject.
                if p.cp > 1 and p.ep > 1:
                    raise ValueError(f"trainer.parallel: cp ({p.cp}) > 1 with ep ({p.ep}) > 1 is not supported by the "
                                     "bundled trainer; use one of them")
            if n % p.tp:
                raise ValueError(f"trainer.parallel.tp ({p.tp}) must divide the job's GPUs "
                                 f"({r.nodes} nodes × {r.gpus_per_node} = {n})")
            rep = p.dp_replicate
            if n % (p.tp * rep):
                raise ValueError(f"trainer.parallel: dp_replicate ({rep}) × tp ({p.tp}) must divide the job's "
                                 f"GPUs ({r.nodes} nodes × {r.gpus_per_node} = {n})")
            dp = p.dp_shard if p.dp_shard != -1 else n // (p.tp * rep)
            if rep * dp * p.tp != n:
                what = f"dp_replicate ({rep}) × " if rep > 1 else ""
                raise ValueError(f"trainer.parallel: {what}dp_shard ({p.dp_shard}) × tp ({p.tp}) = {rep * dp * p.tp} "
                                 f"but the job has {n} GPUs ({r.nodes} nodes × {r.gpus_per_node})")
            if rep > 1 and (p.replicate or p.ep > 1):
                raise ValueError("trainer.parallel.dp_replicate > 1 (HSDP) cannot be combined with "
                                 + ("replicate: true" if p.replicate else "ep > 1") + " in the bundled trainer")
            if n % p.ep or dp % p.ep:
                raise ValueError(f"trainer.parallel.ep ({p.ep}) must divide dp_shard ({dp}) "
                                 f"(GPUs {n} = dp_shard {dp} × tp {p.tp})")
            ms = t.model_spec
            if p.ep > 1 and ms.moe is None:
                raise ValueError(f"trainer.parallel.ep ({p.ep}) needs a MoE model; {t.model!r} is dense")
            if ms.moe is not None and ms.moe.n_experts % p.ep:
                raise ValueError(f"trainer.parallel.ep ({p.ep}) must divide n_experts ({ms.moe.n_experts})")
            if ms.n_heads % p.tp or ms.kv_heads % p.tp:
                raise ValueError(f"trainer.parallel.tp ({p.tp}) must divide n_heads ({ms.n_heads}) "
                                 f"and n_kv_heads ({ms.kv_heads})")
            if t.batch_size % (dp * rep):
                raise ValueError(f"trainer.batch_size ({t.batch_size}) must be divisible by the "
                                 f"data-parallel degree ({dp * rep})")
        if isinstance(self.checkpoint.every_steps, int) and t.steps is not None:
            pass
        return self

    # ---- derived -----------------------------------------------------------------------
    @property
    def run_uri(self) -> str:
        """The run URI with {name} filled in; a plain path becomes an absolute file:// URI."""
        uri = self.checkpoint.uri.replace("{name}", self.name)
        if "://" not in uri:
            return "file://" + str(Path(uri).expanduser().resolve())
        if uri.startswith("file://"):
            path = uri[len("file://"):]
            return "file://" + str(Path(path).expanduser().resolve())
        return uri

    @property
    def parallel_degrees(self) -> Parallel:
        """The explicit parallel degrees (``auto`` resolves to plain FSDP over every GPU here;
        the orchestrator's planner replaces it with its pick before launch)."""
        n = self.resources.total_gpus
        if self.trainer is None:
            return Parallel(dp_shard=n, tp=1, ep=1)
        p = self.trainer.parallel
        if p == "auto":
            return Parallel(dp_shard=n, tp=1, ep=1)
        dp = p.dp_shard if p.dp_shard != -1 else n // (p.tp * p.dp_replicate * p.pp * p.cp)
        return p.model_copy(update={"dp_shard": dp})

    @property
    def is_command(self) -> bool:
        """Does the job run the user's own command (not the bundled trainer)?"""
        return self.command is not None

    @property
    def uses_spot(self) -> bool:
        return self.resources.spot is not False


# ---- loading with messages that name the field and the YAML line ----------------------------

def _yaml_line(node: Any, loc: tuple[Any, ...]) -> int | None:
    """1-based YAML line of the node at ``loc`` (or its deepest existing parent): a key's own
    line (``trainer:``, not its first field's, when the error is about the section)."""
    import yaml

    line = None
    for key in loc:
        if node is None:
            break
        if line is None:
            line = node.start_mark.line + 1
        nxt = None
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                if k.value == str(key):
                    nxt = v
                    line = k.start_mark.line + 1
                    break
        elif isinstance(node, yaml.SequenceNode) and isinstance(key, int) and key < len(node.value):
            nxt = node.value[key]
            line = nxt.start_mark.line + 1
        if nxt is None:
            return line
        node = nxt
    if node is not None and (line is None or not isinstance(node, (yaml.MappingNode, yaml.SequenceNode))):
        line = node.start_mark.line + 1
    return line


def _clean_loc(loc: tuple[Any, ...]) -> tuple[Any, ...]:
    # pydantic adds union-branch tags (e.g. "ModelSpec", "literal['auto']", "function-after[...]")
    out = []
    for part in loc:
        if isinstance(part, str) and (part[:1].isupper() or "[" in part or part in ("bool", "int", "str", "float")):
            continue
        out.append(part)
    return tuple(out)


_FIELD_PATH = re.compile(r"\b(?:resources|trainer|command|checkpoint|budget|teardown|recovery)(?:\.[a-z_]+)+")


def _in_yaml(root: Any, path: tuple[str, ...]) -> bool:
    import yaml

    node = root
    for key in path:
        if not isinstance(node, yaml.MappingNode):
            return False
        node = next((v for k, v in node.value if k.value == key), None)
        if node is None:
            return False
    return True


def _named_field(msg: str, loc: tuple[Any, ...], root: Any) -> tuple[str, ...] | None:
    """The field a cross-field message names (``trainer.parallel.tp (2) must divide …``, raised by
    a validator of the whole spec or of a section, so pydantic's location is that spec or
    section), when it lies below ``loc``: the line to point at is that field's — or its deepest
    part the file gives (a default the file leaves out has no line), if deeper than ``loc``."""
    want = tuple(str(x) for x in loc)
    if root is None:
        return None
    for m in _FIELD_PATH.finditer(msg):
        parts = tuple(m.group(0).split("."))
        if parts[:len(want)] != want:
            continue
        while len(parts) > len(want) and not _in_yaml(root, parts):
            parts = parts[:-1]
        if len(parts) > len(want):
            return parts
    return None


def format_validation_error(err: ValidationError, source: str, root: Any = None) -> str:
    """One message: the first error's field path and line (others counted), naming the file.
    A cross-field error names the field it is about; that field's line is given."""
    errors = err.errors(include_url=False)
    # Prefer the most specific error of a union (the deepest path).
    errors.sort(key=lambda e: -len(_clean_loc(e["loc"])))
    first = errors[0]
    loc = _clean_loc(first["loc"])
    msg = first["msg"].removeprefix("Value error, ")
    named = _named_field(msg, loc, root) if first["type"] == "value_error" else None
    if named is not None:
        loc = named
    path = ".".join(str(p) for p in loc) or "(top level)"
    if first["type"] == "extra_forbidden":
        msg = "unknown key (check the spelling; `dtrun schema` lists the fields)"
    elif first["type"] == "missing":
        msg = "required field is missing"
    bad = first.get("input")
    if first["type"] not in ("extra_forbidden", "missing") and isinstance(bad, (str, int, float, bool)) \
            and repr(bad) not in msg and str(bad) not in msg:
        msg = f"{msg} (got {bad!r})"
    where = source
    if root is not None:
        line = _yaml_line(root, loc)
        if line:
            where = f"{source}:{line}"
    more = len({tuple(_clean_loc(e['loc'])) for e in errors}) - 1
    suffix = f" (and {more} more problem{'s' if more > 1 else ''})" if more > 0 else ""
    if named is not None and msg.startswith(path):
        return f"{where}: {msg}{suffix}"  # (the message opens with the field's path already)
    return f"{where}: {path}: {msg}{suffix}"


def parse_spec(data: Any, source: str = "<job>", root: Any = None) -> JobSpec:
    if not isinstance(data, dict):
        kind = "empty" if data is None else f"a {type(data).__name__}, not a mapping"
        raise SpecError(f"{source}: the job spec is {kind}; expected keys like name, resources, trainer")
    try:
        return JobSpec.model_validate(data)
    except ValidationError as e:
        raise SpecError(format_validation_error(e, source, root)) from None


class DuplicateKey(Exception):
    """A mapping of the job file gives one key twice (YAML would keep the last, silently)."""


@functools.cache
def _strict_loader() -> type:
    """The safe loader (libyaml's parser when built with it: the dry run's parse) that refuses a
    key given twice in one mapping instead of keeping the last. Merge keys (``<<: *base``) still
    override as YAML says; only keys written twice are refused."""
    import yaml

    base = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

    class StrictLoader(base):  # type: ignore[misc, valid-type]
        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            seen: set[str] = set()
            for key, _ in node.value:
                if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                    if key.value in seen:
                        raise DuplicateKey(key.value)
                    seen.add(key.value)
            return super().construct_mapping(node, deep=deep)

    return StrictLoader


def _duplicate_message(source: str, root: Any) -> str:
    """``job.yaml:4: name: given twice (first at line 3); …`` for the first key written twice."""
    import yaml

    def walk(node: Any, path: tuple[str, ...]) -> tuple[tuple[str, ...], int, int] | None:
        if isinstance(node, yaml.MappingNode):
            first: dict[str, int] = {}
            for k, v in node.value:
                if isinstance(k, yaml.ScalarNode) and k.tag != "tag:yaml.org,2002:merge":
                    if k.value in first:
                        return path + (k.value,), k.start_mark.line + 1, first[k.value]
                    first[k.value] = k.start_mark.line + 1
                found = walk(v, path + (str(getattr(k, "value", k)),))
                if found:
                    return found
        elif isinstance(node, yaml.SequenceNode):
            for i, v in enumerate(node.value):
                found = walk(v, path + (str(i),))
                if found:
                    return found
        return None

    found = walk(root, ())
    if found is None:  # (not reached: the loader found one)
        return f"{source}: a key is given twice in one mapping"
    path, line, first = found
    return (f"{source}:{line}: {'.'.join(path)}: given twice (first at line {first}); YAML would keep only the "
            "last one silently — remove one")


def load_spec(path: str | Path) -> JobSpec:
    """Read and validate a job file. Every problem is a SpecError naming the file (and line)."""
    import yaml

    p = Path(path)
    if not p.exists():
        raise SpecError(f"{p}: no such file")
    if p.is_dir():
        raise SpecError(f"{p}: is a directory, expected a job YAML file")
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise SpecError(f"{p}: cannot read: {e}") from None
    loader = _strict_loader()
    try:
        data = yaml.load(text, Loader=loader)  # noqa: S506 - a safe loader
    except DuplicateKey:
        raise SpecError(_duplicate_message(str(p), yaml.compose(text, Loader=loader))) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{p}:{mark.line + 1}" if mark else str(p)
        problem = getattr(e, "problem", None) or str(e)
        raise SpecError(f"{where}: invalid YAML: {problem}") from None
    if isinstance(data, dict):
        try:
            spec = JobSpec.model_validate(data)
        except ValidationError as e:  # the node tree (line numbers) only for a message
            raise SpecError(format_validation_error(e, str(p), yaml.compose(text, Loader=loader))) from None
    else:
        spec = parse_spec(data, str(p))  # (raises: not a mapping)
    spec = anchor_paths(spec, p.resolve().parent)
    if spec.command is not None:
        for field, problem in _command_problems(spec.command):
            line = _yaml_line(yaml.compose(text, Loader=loader), ("command", field))
            raise SpecError(f"{p}{':' + str(line) if line else ''}: command.{field}: {problem}")
    return spec


_PYTHON = re.compile(r"(.*/)?python[0-9.]*")


def _command_problems(c: Command) -> list[tuple[str, str]]:
    """What in a command section (its paths anchored) cannot work on a node, found before renting:
    the code folder, the requirements file, a ``run`` that torchrun would misread (``python
    train.py`` under ``torchrun: true``: torchrun takes the script itself), a script not in the
    code folder, unbalanced quotes. (field, why) pairs, the first one is reported."""
    import shlex

    code = Path(c.code)
    if not code.is_dir():
        return [("code", f"{c.code} is not a folder")]
    if c.requirements and not (code / c.requirements).is_file():
        return [("requirements", f"{c.requirements} is not a file in the code folder {code}")]
    try:
        words = shlex.split(c.run)
    except ValueError as e:
        return [("run", f"cannot split {c.run!r} into words: {e}")]
    if not words:
        return [("run", "is empty")]
    if c.torchrun and os.path.basename(words[0]) in ("torchrun", "accelerate", "deepspeed"):
        return [("run", f"{c.run!r}: dtrun already runs the command under torchrun (one process per GPU, "
                        "rendezvous across nodes); give the script and its arguments, or set "
                        f"command.torchrun: false to run {words[0]!r} yourself")]
    if c.torchrun and _PYTHON.fullmatch(words[0]):
        return [("run", f"{c.run!r}: under torchrun (command.torchrun: true) give the script as torchrun takes "
                        f"it ({' '.join(words[1:]) or 'train.py'!s}, or -m pkg.train), without {words[0]!r}; "
                        "or set command.torchrun: false to run it as given")]
    if not c.torchrun and words[0].endswith(".py") and "/" not in words[0]:
        return [("run", f"{c.run!r}: with command.torchrun: false the command runs as a shell would, which looks "
                        f"{words[0]!r} up on PATH; write `python {c.run}`")]
    script = words[0] if c.torchrun else (words[1] if _PYTHON.fullmatch(words[0]) and len(words) > 1 else None)
    if (script and script.endswith(".py") and "$" not in script and not Path(script).is_absolute()
            and not (code / script).is_file()):
        return [("run", f"{script} is not in the code folder {code} (command.code, relative to the job file)")]
    return []


def anchor_paths(spec: JobSpec, base: str | Path) -> JobSpec:
    """Relative local paths in the spec (``checkpoint.uri``, ``trainer.data``, ``trainer.val_data``,
    ``command.code``) resolved against ``base``, the job file's folder — not the working directory,
    so one job file trains into one place whichever folder ``dtrun up`` runs in."""
    from orchestrator.contract.runuri import anchored

    base = str(base)
    upd: dict[str, Any] = {"checkpoint": spec.checkpoint.model_copy(update={"uri": anchored(spec.checkpoint.uri, base)})}
    t = spec.trainer
    if t is not None:
        upd["trainer"] = t.model_copy(update={
            "data": t.data if t.data == "synthetic" else anchored(t.data, base),
            "val_data": anchored(t.val_data, base) if t.val_data not in (None, "synthetic") else t.val_data})
    if spec.command is not None:
        code = (Path(base) / Path(spec.command.code).expanduser()).resolve()
        upd["command"] = spec.command.model_copy(update={"code": str(code)})
    return spec.model_copy(update=upd)


def spec_to_yaml(spec: JobSpec) -> str:
    import yaml

    return yaml.safe_dump(json.loads(spec.model_dump_json(exclude_none=True)), sort_keys=False)


def field_docs(module: Any) -> dict[str, dict[str, str]]:
    """{class: {field: the docstring under it}} for the classes of ``module`` (what pydantic's
    ``use_attribute_docstrings`` would read)."""
    import ast
    import inspect

    out: dict[str, dict[str, str]] = {}
    for node in ast.parse(inspect.getsource(module)).body:
        if isinstance(node, ast.ClassDef):
            docs = out[node.name] = {}
            for a, b in zip(node.body, node.body[1:]):
                if (isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name) and isinstance(b, ast.Expr)
                        and isinstance(b.value, ast.Constant) and isinstance(b.value.value, str)):
                    docs[a.target.id] = inspect.cleandoc(b.value.value)
    return out


def json_schema() -> dict[str, Any]:
    """The job file's JSON schema, each field described by its docstring (editor completion)."""
    import sys

    from orchestrator.plan import presets, sections

    schema = JobSpec.model_json_schema()
    defs = schema.get("$defs", {})
    for name, docs in {**field_docs(presets), **field_docs(sections), **field_docs(sys.modules[__name__])}.items():
        props = (schema if name == JobSpec.__name__ else defs.get(name, {})).get("properties", {})
        for f, doc in docs.items():
            if f in props:
                props[f].setdefault("description", doc)
    return schema
