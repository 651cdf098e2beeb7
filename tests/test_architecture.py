"""The package's shape, checked from source with ``ast``: imports flow downward without circles, no module reads
another's private names, modules stay small, and the CLI and tests use the public API only."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "zeroio"
TESTS = ROOT / "tests"

# --------------------------------------------------------------------------- the rules, as data

# Lowest first. A module may import modules of its own layer or below, never above. Entries are the names
# directly under zeroio/ (a subpackage such as _formats/ counts as one entry). Every module must be listed:
# a new one fails test_every_module_has_a_layer until it is placed here.
LAYERS: list[tuple[str, ...]] = [
    # 0. vocabulary: no zeroio imports but each other
    ("errors", "_types", "_constants", "_messages", "_dtypes", "_env"),
    # 1. storage (_io/): byte sources to read from (local, remote, CRC-checked), primitives for files to write,
    #    progress reporting (shared by the writers and the loader); the one cross-rank outcome exchange (_ranks:
    #    shared by the distributed writers, the sharded loader and the verbs called on every rank), and the same
    #    exchange among the processes of one host over a Unix socket, without torch (_host_ranks)
    ("_io", "_ranks", "_host_ranks"),
    # 2. the restricted unpickler world: reading with inert stand-ins, plain trees, DeepSpeed-record writing
    ("_pickles",),
    # 3. the readers (_formats/): contracts at the face (Checkpoint, metadata, options, partition arithmetic, read
    #    plans), then the families, then the FORMATS registry (see FORMATS_LAYERS)
    ("_formats",),
    # 4. the writers (_write/): the engine (plan -> execute -> commit), every output format behind WRITERS, the
    #    distributed execution of any of them, atomic outputs, side files, URL outputs
    ("_write",),
    # 5. the verbs and what only they use
    ("_convert", "_every_rank", "_load", "_verify", "_reshard", "_hub", "_hub_errors", "_model_card"),
    # 6. the public namespace
    ("__init__",),
    # 7. the command line
    # ... and the drop-in for DeepSpeed's zero_to_fp32 functions, written against the public API like the CLI
    ("cli", "__main__", "zero_to_fp32"),
]

# Modules over MAX_LINES, each with the reason it may stay longer. Keep this short.
MAX_LINES = 500
LONG_MODULES: dict[str, str] = {}

# Private attributes of other libraries that zeroio must read, with why. Everything else named ``_x`` on an
# object other than ``self``/``cls`` is another module's private state.
FOREIGN_PRIVATE_ATTRIBUTES: dict[str, str] = {
    "_parameters": "torch.nn.Module: a module's own parameters without recursion or hooks (loading in place)",
    "_buffers": "torch.nn.Module: a module's own buffers, as load_state_dict reads them",
    "_non_persistent_buffers_set": "torch.nn.Module: buffers that are never saved (not reported as missing)",
    "_dtype_to_storage_type_map": "torch.storage: the storage class name torch.save writes for a dtype",
    "_Pickler": "pickle: the pure-Python Pickler, whose dispatch table can be extended (the C one's cannot)",
    "_replace": "namedtuple's public API (named with an underscore to avoid field clashes)",
    "_asdict": "namedtuple's public API",
    "_fields": "namedtuple's public API",
    "_is_owned": "threading.RLock: whether this thread holds it, as threading.Condition asks; the descriptor "
    "pool's release must not wait for its own thread (a finalizer run inside the pool, zeroio/_io/fd_pool.py)",
    "_get_default_store": "torch.distributed: the job's key-value store, where ranks calling convert claim a "
    "destination without a collective, and a failing rank raises an alarm (zeroio/_ranks.py)",
    "_exit": "os: a torchrun worker leaves without the interpreter's teardown once its outputs are synced "
    "(zeroio/__main__.py)",
}

# What the CLI and the tests may import: the public API ...
PUBLIC_MODULES = {"zeroio", "zeroio.errors", "zeroio.zero_to_fp32"}
# ... plus, for tests, the command's entry point (``zeroio.cli.main``, the ``zeroio`` script) ...
TEST_ENTRY_POINTS = {"zeroio.cli"}
# ... plus pure internals that unit tests exercise directly because no public call shows them whole.
PURE_INTERNALS: dict[str, str] = {
    "zeroio._formats.partition": "ZeRO partition arithmetic (plain integers)",
    "zeroio._env": "parsing of ZEROIO_* values (byte counts, positive counts): each refusal names its variable",
    "zeroio._write.sharding": "shard splitting and HF size/index rules, and which process writes which shard",
    "zeroio._write.readers": "which processes of a distributed conversion read (one per host by default)",
    "zeroio._write.safetensors_writer": "the safetensors writer's planning (header, slots) and chunk writing",
    "zeroio._io.fileio": "pwrite/preallocate/fsync helpers and chunk buffers",
    "zeroio._io.crc32": "CRC-32 arithmetic (crc32_combine), checked against zlib",
    "zeroio._pickles": "the restricted unpickler: its contract is the raw tree, which no public call returns",
    "zeroio._dtypes": "the torch-free dtype vocabulary, checked against torch's own dtypes",
    "zeroio._formats.stored_bits": "fp32 master vs 16-bit copy on raw bytes (rounded by zeroio._io.casts), against torch",
    "zeroio._load.shard_slices": "which global elements a DTensor placement gives a rank, checked against torch's",
    "zeroio._io.casts": "fp32/bf16/fp16 casts on raw bytes with numpy, swept over bit patterns against torch's casts",
    "zeroio._formats.name_patterns": "bounded regex matching: which patterns are refused, and match results equal re's",
    "zeroio.cli._progress": "when progress lines print (every 10 % or 10 s, at 100 %), against an injected clock",
    "zeroio._io.direct_read": "page-aligned cuts of a byte range and O_DIRECT reads of them into a congruent window: "
    "only a load to CUDA reaches them, so a CPU-only machine tests them here",
    "zeroio._io.fd_pool": "the descriptor pool's thread contract (a release while another thread is inside it, or "
    "from inside it), against an injected opener: no public call can hold a thread inside the process's pool",
}


# --------------------------------------------------------------------------- reading the source


@dataclass(frozen=True)
class Import:
    """One import statement's target, resolved to a dotted module (or ``module.name``) path."""

    module: str  # the module imported from (``zeroio._convert``), or the module itself for ``import x``
    name: str | None  # the name imported from it (``convert``), None for ``import x`` / a whole module
    line: int


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _package_modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


MODULES = _package_modules()


def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _imports(path: Path, tree: ast.Module) -> Iterator[Import]:
    """Every import in ``tree``, at any depth (inside functions and ``if TYPE_CHECKING:`` too)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(alias.name, None, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                if f"{base}.{alias.name}" in MODULES:
                    yield Import(f"{base}.{alias.name}", None, node.lineno)
                else:
                    yield Import(base, alias.name, node.lineno)


def _unit(module: str) -> str | None:
    """The layer table's entry for a zeroio module: the first name under zeroio/ (``__init__`` for zeroio)."""
    if module == "zeroio":
        return "__init__"
    if not module.startswith("zeroio."):
        return None
    return module.split(".")[1]


def _layer_of() -> dict[str, int]:
    return {unit: level for level, units in enumerate(LAYERS) for unit in units}


def _graph() -> dict[str, set[str]]:
    """zeroio module -> the zeroio modules it imports (explicit imports only, not implicit parent packages)."""
    graph: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        targets = set()
        for imp in _imports(path, _parse(path)):
            if imp.module in MODULES and imp.module != module:
                targets.add(imp.module)
        graph[module] = targets
    return graph


# --------------------------------------------------------------------------- (a) no import circles


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_no_import_cycles():
    """No two zeroio modules import each other, directly or through others (imports inside functions count)."""
    cycles = _cycles(_graph())
    assert cycles == [], "import circles between zeroio modules:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_cycle_finder_finds_cycles():
    """The checker itself: a circle through three modules is found, a chain is not."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


# --------------------------------------------------------------------------- (b) layers


def test_every_module_has_a_layer():
    """Each module under zeroio/ is placed in LAYERS, so the table stays complete."""
    layer = _layer_of()
    unknown = sorted({_unit(m) for m in MODULES} - set(layer) - {None})
    assert unknown == [], f"modules missing from LAYERS in {Path(__file__).name}: {unknown}"


def test_imports_flow_downward():
    """A module imports only its own layer or lower ones (see LAYERS)."""
    layer = _layer_of()
    offenders = []
    for module, targets in sorted(_graph().items()):
        source = _unit(module)
        if source not in layer:
            continue  # reported by test_every_module_has_a_layer
        for target in sorted(targets):
            unit = _unit(target)
            if unit in layer and unit != source and layer[unit] > layer[source]:
                offenders.append(f"{module} (layer {layer[source]}) imports {target} (layer {layer[unit]})")
    assert offenders == [], "imports from a higher layer:\n" + "\n".join(offenders)


READERS_FACE = "zeroio._formats"
"""The format readers' package: modules above its layer import its face (``__init__``), never its submodules."""


def test_upper_layers_import_readers_through_their_face():
    """The write engine and the verbs (layers above ``_formats``) import ``zeroio._formats``, not its modules, so
    a reader's module can be split or renamed without touching them (the reader contract is the face's names)."""
    layer = _layer_of()
    offenders = []
    for module, targets in sorted(_graph().items()):
        unit = _unit(module)
        if unit not in layer or layer[unit] <= layer["_formats"]:
            continue
        offenders += [f"{module} imports {t}" for t in sorted(targets) if t.startswith(READERS_FACE + ".")]
    assert offenders == [], f"imports past {READERS_FACE}'s face (export the name there):\n" + "\n".join(offenders)


# Inside a layer's package, the same rule one level down: lowest first, a module imports its own sub-layer or lower
# ones. Entries are module names relative to the package; a family folder (``zero``) stands for every module in it.
SUBLAYERS: dict[str, list[tuple[str, ...]]] = {
    "zeroio._formats": [
        # the face's contracts: what every reader and every layer above relies on; they import no family
        (
            "checkpoint",
            "metadata",
            "options",
            "partition",
            "read_plans",
            "planned_checkpoint",
            "validate",
            "stored_bits",
            "tp_rules",
            "name_patterns",
            "view",
        ),
        # the families: each reads one kind of checkpoint, built on the contracts (and on each other)
        ("zero", "composite", "files", "dcp", "optimizer", "verl", "lora"),
        # the registry (FORMATS, open_checkpoint): the only module that knows every family
        ("__init__",),
    ],
    "zeroio._write": [
        # the engine and what every writer shares
        (
            "result",
            "options",
            "comm",
            "atomic",
            "own_files",
            "overlap",
            "sharding",
            "readers",
            "byte_writes",
            "safetensors_writer",
            "side_files",
            "plan",
            "shard_files",
            "shared_checks",
            "phases",
            "remote_output",
        ),
        # the writers, one module per output format (and the distributed execution of the engine)
        (
            "hf_writer",
            "group_thread",
            "one_reader",
            "distributed",
            "optimizer_files",
            "lightning_writer",
            "universal_writer",
            "dcp_writer",
            "peft_writer",
        ),
        # the registry (WRITERS, write_output)
        ("__init__",),
    ],
}


def _sub_unit(package: str, module: str) -> str | None:
    """The SUBLAYERS entry of a module inside ``package`` (``__init__`` for the package itself)."""
    if module == package:
        return "__init__"
    if not module.startswith(package + "."):
        return None
    return module[len(package) + 1 :].split(".")[0]


def _sublayer_offenders(package: str, graph: dict[str, set[str]]) -> list[str]:
    level = {unit: n for n, units in enumerate(SUBLAYERS[package]) for unit in units}
    offenders = []
    for module, targets in sorted(graph.items()):
        source = _sub_unit(package, module)
        if source is None:
            continue
        for target in sorted(targets):
            unit = _sub_unit(package, target)
            if unit is not None and unit != source and level[unit] > level[source]:
                offenders.append(f"{module} imports {target}")
    return offenders


def test_every_module_of_a_layered_package_has_a_sublayer():
    """Each module of ``_formats/`` and ``_write/`` is placed in SUBLAYERS, so the tables stay complete."""
    missing = []
    for package, layers in SUBLAYERS.items():
        known = {unit for units in layers for unit in units}
        missing += [m for m in MODULES if (unit := _sub_unit(package, m)) is not None and unit not in known]
    assert missing == [], f"modules missing from SUBLAYERS in {Path(__file__).name}: {sorted(missing)}"


def test_nothing_climbs_back_up_inside_a_package():
    """Inside ``_formats/`` the contracts import no family and no family imports the registry; inside ``_write/``
    the engine imports no writer. Imports inside functions and under ``TYPE_CHECKING`` count like any other."""
    graph = _graph()
    offenders = [line for package in SUBLAYERS for line in _sublayer_offenders(package, graph)]
    assert offenders == [], "imports from a higher sub-layer:\n" + "\n".join(offenders)


def test_climbing_imports_are_seen_wherever_they_are():
    """The checker itself: an import inside a function and one under ``if TYPE_CHECKING:`` are both edges."""
    path = PACKAGE / "_formats" / "_architecture_probe.py"
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from .read_plans import ReadPlan\n"
        "def f():\n"
        "    from .zero.reader import open_zero\n"
    )
    found = {imp.module for imp in _imports(path, ast.parse(source))}
    assert {"zeroio._formats.read_plans", "zeroio._formats.zero.reader"} <= found
    graph = {
        "zeroio._formats.options": {"zeroio._formats.zero.reader"},
        "zeroio._formats.zero.reader": {"zeroio._formats"},
    }
    assert _sublayer_offenders("zeroio._formats", graph) == [
        "zeroio._formats.options imports zeroio._formats.zero.reader",
        "zeroio._formats.zero.reader imports zeroio._formats",
    ]


NEVER_IMPORTS: dict[str, tuple[str, str]] = {
    "_load": ("_write", "loading writes nothing: what both need (progress reporting) lives below both, in _io/"),
}
"""Layers that must not import another layer although the layer order would allow it, with why."""


def test_loading_never_imports_the_writers():
    """``_load`` imports nothing from ``_write`` (see NEVER_IMPORTS)."""
    offenders = [
        f"{module} imports {target} ({NEVER_IMPORTS[_unit(module)][1]})"
        for module, targets in sorted(_graph().items())
        if _unit(module) in NEVER_IMPORTS
        for target in sorted(targets)
        if _unit(target) == NEVER_IMPORTS[_unit(module)][0]
    ]
    assert offenders == [], "\n".join(offenders)


# --------------------------------------------------------------------------- (c) no private names across modules


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _own_private_names(tree: ast.Module) -> set[str]:
    """Private names a module defines itself: class attributes, functions, ``self._x`` assignments, dict keys.

    Reading one of them on another object of the same module's classes (``type(obj)._x``, ``other._x`` in a
    comparison) is the module's own business, not a reach into another module.
    """
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and _private(node.name):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and _private(node.id):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _private(node.attr):
            names.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _private(node.value):
            names.add(node.value)  # type(name, bases, {"_x": ...}) and __slots__ entries
    return names


def _private_accesses(path: Path) -> Iterator[str]:
    tree = _parse(path)
    where = path.relative_to(ROOT)
    own = _own_private_names(tree)
    for imp in _imports(path, tree):
        if imp.name is not None and imp.module in MODULES and _private(imp.name):
            yield f"{where}:{imp.line}: from {imp.module} import {imp.name}"
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not _private(node.attr):
            continue
        owner = node.value
        if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
            continue
        if isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super":
            continue
        if node.attr in FOREIGN_PRIVATE_ATTRIBUTES or node.attr in own:
            continue
        yield f"{where}:{node.lineno}: {ast.unparse(node)}"


def test_no_module_reads_another_modules_private_names():
    """No ``from .x import _name``, ``module._name`` or ``obj._attr`` (obj not self/cls) in zeroio/."""
    offenders = [line for path in MODULES.values() for line in _private_accesses(path)]
    assert offenders == [], (
        f"{len(offenders)} reads of another module's private names (expose a public name instead, or add a "
        "foreign library's attribute to FOREIGN_PRIVATE_ATTRIBUTES with the reason):\n" + "\n".join(offenders)
    )


def test_private_access_finder_sees_each_form():
    """The checker itself: each forbidden form is reported; self/cls, super() and dunders are not."""
    path = PACKAGE / "_architecture_probe.py"  # named inside the package so relative imports resolve
    source = (
        "from ._convert import _plan, convert\n"
        "from . import _constants\n"
        "def f(ckpt, module):\n"
        "    ckpt._sources; module._parameters; ckpt.__class__\n"
        "class A:\n"
        "    def g(self):\n"
        "        self._x; super()._y\n"
    )
    tree = ast.parse(source)
    found = []
    for imp in _imports(path, tree):
        if imp.name is not None and imp.module in MODULES and _private(imp.name):
            found.append(f"{imp.module}.{imp.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            if isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super":
                continue
            if node.attr not in FOREIGN_PRIVATE_ATTRIBUTES:
                found.append(ast.unparse(node))
    assert found == ["zeroio._convert._plan", "ckpt._sources"]


# --------------------------------------------------------------------------- (d) small modules


def test_modules_are_small():
    """No module is over MAX_LINES lines unless LONG_MODULES says why."""
    offenders = []
    for module, path in MODULES.items():
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > MAX_LINES and module not in LONG_MODULES:
            offenders.append(f"{path.relative_to(ROOT)}: {lines} lines")
    assert offenders == [], f"modules over {MAX_LINES} lines (split them by job):\n" + "\n".join(sorted(offenders))


MAX_FUNCTION_LINES = 100
"""Longest function body, docstring excluded (a public verb's docstring is its documentation, not its logic)."""


def _function_lengths(tree: ast.Module) -> Iterator[tuple[str, int, int]]:
    """(name, first line, lines of code) for every function and method, nested ones included."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            first = body[0]
            docstring = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
            if docstring and isinstance(first.value.value, str) and len(body) > 1:
                body = body[1:]
            header = node.body[0].lineno - node.lineno  # the signature (decorators not counted)
            assert body[-1].end_lineno is not None
            yield node.name, node.lineno, header + body[-1].end_lineno - body[0].lineno + 1


def test_functions_are_short():
    """No function is over MAX_FUNCTION_LINES lines (its signature and code; the docstring does not count)."""
    offenders = [
        f"{path.relative_to(ROOT)}:{line}: {name} ({length} lines)"
        for path in MODULES.values()
        for name, line, length in _function_lengths(_parse(path))
        if length > MAX_FUNCTION_LINES
    ]
    assert offenders == [], f"functions over {MAX_FUNCTION_LINES} lines (split them by step):\n" + "\n".join(offenders)


def test_function_length_counts_code_not_docstrings():
    """The checker itself: a docstring is not counted, the signature and every line of code are."""
    source = 'def f(\n    a,\n):\n    """Doc.\n\n    More.\n    """\n    x = 1\n    return x\n'
    assert list(_function_lengths(ast.parse(source))) == [("f", 1, 5)]


# --------------------------------------------------------------------------- (e) the CLI and tests use the public API

_CODE_IN_STRING = re.compile(r"^\s*(?:from|import)\s+(zeroio(?:\.\w+)*)", re.MULTILINE)
_DOTTED_PATH_STRING = re.compile(r"^(zeroio\.\w+(?:\.\w+)*)$")


def _zeroio_uses(path: Path) -> Iterator[tuple[int, str]]:
    """(line, module) for each zeroio module ``path`` imports, including code in strings run as scripts and
    dotted paths such as ``monkeypatch.setattr("zeroio._x.y", ...)``."""
    tree = _parse(path)
    for imp in _imports(path, tree):
        if imp.module == "zeroio" or imp.module.startswith("zeroio."):
            yield imp.line, imp.module
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "zeroio":
            if f"zeroio.{node.attr}" in MODULES:
                yield node.lineno, f"zeroio.{node.attr}"
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            for match in _CODE_IN_STRING.finditer(node.value):
                yield node.lineno, match.group(1)
            dotted = _DOTTED_PATH_STRING.match(node.value)
            if dotted and dotted.group(1).split(".")[1].startswith("_"):
                yield node.lineno, dotted.group(1)


def _test_may_import(module: str) -> bool:
    if module in PUBLIC_MODULES or module in TEST_ENTRY_POINTS:
        return True
    return any(module == pure or module.startswith(pure + ".") for pure in PURE_INTERNALS)


def test_cli_imports_only_the_public_api():
    """zeroio/cli/ and the zero_to_fp32 drop-in call the library through ``zeroio`` and ``zeroio.errors`` only."""
    offenders = []
    for path in [*sorted((PACKAGE / "cli").rglob("*.py")), PACKAGE / "zero_to_fp32.py"]:
        for line, module in _zeroio_uses(path):
            if not (
                module in {"zeroio", "zeroio.errors"} or module == "zeroio.cli" or module.startswith("zeroio.cli.")
            ):
                offenders.append(f"{path.relative_to(ROOT)}:{line}: {module}")
    assert offenders == [], "the CLI imports private zeroio modules:\n" + "\n".join(offenders)


def test_tests_import_only_the_public_api():
    """Tests use ``zeroio``, ``zeroio.errors``, ``zeroio.cli.main`` and the PURE_INTERNALS unit-tested directly."""
    offenders = []
    for path in sorted(TESTS.glob("*.py")):
        if path.name == Path(__file__).name:
            continue  # this file names private modules as data
        for line, module in _zeroio_uses(path):
            if not _test_may_import(module):
                offenders.append(f"{path.relative_to(ROOT)}:{line}: {module}")
    assert offenders == [], (
        "tests import private zeroio modules (use the public API, or test a pure internal listed in "
        "PURE_INTERNALS):\n" + "\n".join(offenders)
    )


# --------------------------------------------------------------------------- (f) the architecture page names every module

ARCHITECTURE_DOC = ROOT / "docs" / "architecture.md"


def _doc_names(module_path: Path) -> tuple[str, ...]:
    """How docs/architecture.md may name a module: its path under zeroio/ in backticks (`_io/sources.py`); a
    package's ``__init__.py`` also by its folder (`_io/`)."""
    rel = module_path.relative_to(PACKAGE).as_posix()
    names = [f"`{rel}`"]
    if module_path.name == "__init__.py" and module_path.parent != PACKAGE:
        names.append(f"`{module_path.parent.relative_to(PACKAGE).as_posix()}/`")
    return tuple(names)


def test_architecture_doc_names_every_module():
    """docs/architecture.md names every module under zeroio/, so its diagram cannot drift from the tree."""
    text = ARCHITECTURE_DOC.read_text(encoding="utf-8")
    missing = [
        names[0] for names in (_doc_names(p) for p in MODULES.values()) if not any(name in text for name in names)
    ]
    assert missing == [], (
        f"modules not named in {ARCHITECTURE_DOC.relative_to(ROOT)} (add each to the layer diagram, as its path "
        f"under zeroio/ in backticks): {', '.join(sorted(missing))}"
    )


# --------------------------------------------------------------------------- (g) loggers that redact


def test_every_logger_comes_from_get_logger():
    """Modules log through ``zeroio._messages.get_logger``, whose filter hides URL credentials (docs/security.md); a
    plain ``logging.getLogger`` would print them."""
    offenders = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for name, path in MODULES.items()
        if name != "zeroio._messages"
        for node in ast.walk(_parse(path))
        if isinstance(node, ast.Attribute) and node.attr == "getLogger"
    ]
    assert offenders == [], "use zeroio._messages.get_logger(__name__):\n" + "\n".join(offenders)
