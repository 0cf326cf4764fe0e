"""How the package is built, checked by reading its source: each object owns its fields, only
``device/`` and ``engine/`` talk to the device, modules stay small, the phase is one object,
one component re-points the optimizer's tensors, and one component makes every change to an
optimizer (``interceptions.py``).

Each check reads the package's AST; each has a negative control that plants what it forbids."""

from __future__ import annotations

import ast
import collections
import warnings
from pathlib import Path

import megatron_offload

PACKAGE = Path(megatron_offload.__file__).parent
MAX_LINES = 450


def _modules(root: Path = PACKAGE) -> dict[str, ast.Module]:
    return {
        str(path.relative_to(root.parent)): ast.parse(path.read_text())
        for path in sorted(root.rglob("*.py"))
    }


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _owners(trees: dict[str, ast.Module]) -> dict[str, set[str]]:
    """Private name -> the classes that define it (a method, a class attribute, or an
    attribute assigned through ``self``)."""
    owners: dict[str, set[str]] = collections.defaultdict(set)
    for tree in trees.values():
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            for node in ast.walk(cls):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _private(
                    node.name
                ):
                    owners[node.name].add(cls.name)
                elif (
                    isinstance(node, ast.Attribute)
                    and isinstance(node.ctx, ast.Store)
                    and isinstance(node.value, ast.Name)
                    and node.value.id == "self"
                    and _private(node.attr)
                ):
                    owners[node.attr].add(cls.name)
            for node in cls.body:
                targets = node.targets if isinstance(node, ast.Assign) else []
                if isinstance(node, ast.AnnAssign):
                    targets = [node.target]
                for target in targets:
                    if isinstance(target, ast.Name) and _private(target.id):
                        owners[target.id].add(cls.name)
    return owners


def private_accesses(trees: dict[str, ast.Module]) -> list[str]:
    """Every read or write of another class's private member, and every private name imported
    from another module of the package: ``"path:line: what"``."""
    owners = _owners(trees)
    found = []

    def visit(path, node, cls):
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, ast.ClassDef) else cls
            if isinstance(child, ast.Attribute) and child.attr in owners:
                base = child.value
                through_self = isinstance(base, ast.Name) and base.id in ("self", "cls")
                if not through_self or cls not in owners[child.attr]:
                    found.append(
                        f"{path}:{child.lineno}: {ast.unparse(child)} "
                        f"(a private member of {', '.join(sorted(owners[child.attr]))})"
                    )
            if isinstance(child, ast.ImportFrom) and child.level:
                for alias in child.names:
                    if _private(alias.name):
                        found.append(
                            f"{path}:{child.lineno}: imports {alias.name} from {child.module}"
                        )
            visit(path, child, inner)

    for path, tree in trees.items():
        visit(path, tree, None)
    return found


def test_no_module_reaches_into_another_objects_private_members():
    assert private_accesses(_modules()) == []


def test_the_private_access_scan_finds_a_planted_access():
    planted = {
        "megatron_offload/a.py": ast.parse(
            "class Engine:\n"
            "    def __init__(self):\n"
            "        self._host = 1\n"
            "    def _relayout(self):\n"
            "        pass\n"
        ),
        "megatron_offload/b.py": ast.parse(
            "from .a import _helper\n"
            "class Mixin:\n"
            "    def use(self, engine):\n"
            "        engine._relayout()\n"
            "        return self._host\n"
        ),
    }
    found = private_accesses(planted)
    assert len(found) == 3, found
    assert any("engine._relayout" in line for line in found)
    assert any("self._host" in line and "Engine" in line for line in found)
    assert any("imports _helper" in line for line in found)


# What a Device does (``device/base.py``): copies, streams, events, memory.
DEVICE_CALLS = frozenset(
    {
        "host_buffer",
        "free_host_buffer",
        "release",
        "regrow",
        "empty",
        "current_stream",
        "new_stream",
        "retire_stream",
        "use_stream",
        "wait_stream",
        "record_event",
        "elapsed_ms",
        "wait_event",
        "synchronize_event",
        "record_stream",
        "copy",
        "synchronize",
    }
)


def device_calls(trees: dict[str, ast.Module]) -> list[str]:
    """Calls of a device's methods (``device.copy(...)``, ``engine.device.record_event(...)``)
    and of ``torch.cuda`` outside ``device/`` and ``engine/``."""
    found = []
    for path, tree in trees.items():
        parts = Path(path).parts
        if len(parts) > 2 and parts[1] in ("device", "engine"):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                continue
            owner = node.func.value
            owner_name = (
                owner.attr
                if isinstance(owner, ast.Attribute)
                else owner.id
                if isinstance(owner, ast.Name)
                else ""
            )
            text = ast.unparse(node.func)
            if (owner_name == "device" and node.func.attr in DEVICE_CALLS) or text.startswith(
                "torch.cuda."
            ):
                found.append(f"{path}:{node.lineno}: {text}(...)")
    return found


def test_only_device_and_engine_talk_to_the_device():
    assert device_calls(_modules()) == []


def test_the_device_call_scan_finds_a_planted_call():
    planted = {
        "megatron_offload/chunked/x.py": ast.parse(
            "def f(engine, device):\n"
            "    engine.device.record_event(None)\n"
            "    device.copy(a, b)\n"
            "    torch.cuda.synchronize()\n"
            "    engine.device.is_accelerator\n"
        ),
        "megatron_offload/engine/y.py": ast.parse("def g(device):\n    device.copy(a, b)\n"),
    }
    found = device_calls(planted)
    assert len(found) == 3 and all(
        line.startswith("megatron_offload/chunked/x.py") for line in found
    )


def host_allocations(trees: dict[str, ast.Module]) -> list[str]:
    """Calls of ``host_buffer`` / ``free_host_buffer`` outside ``device/`` (which defines
    them) and ``HostBudget`` (the one allocator, ``engine/host.py``)."""
    found = []
    for path, tree in trees.items():
        parts = Path(path).parts
        if len(parts) > 2 and parts[1] == "device":
            continue
        allowed = {
            id(node)
            for cls in ast.walk(tree)
            if isinstance(cls, ast.ClassDef)
            and cls.name == "HostBudget"
            and path == "megatron_offload/engine/host.py"
            for node in ast.walk(cls)
        }
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("host_buffer", "free_host_buffer")
                and id(node) not in allowed
            ):
                found.append(f"{path}:{node.lineno}: {ast.unparse(node.func)}(...)")
    return found


def test_every_host_buffer_comes_from_the_one_allocator():
    assert host_allocations(_modules()) == []


def test_the_host_allocation_scan_finds_planted_calls():
    planted = {
        "megatron_offload/engine/host.py": ast.parse(
            "class HostBudget:\n"
            "    def allocate(self, device):\n"
            "        return device.host_buffer(1)\n"
            "class HostArena:\n"
            "    def replace(self):\n"
            "        return self.device.host_buffer(1)\n"
        ),
        "megatron_offload/engine/adopted.py": ast.parse(
            "def f(device, b):\n    device.free_host_buffer(b)\n"
        ),
        "megatron_offload/device/cpu.py": ast.parse("def g(self):\n    self.host_buffer(1)\n"),
    }
    found = host_allocations(planted)
    assert len(found) == 2 and "host.py:6" in found[0] and "adopted.py:2" in found[1], found


def oversized(sizes: dict[str, int]) -> dict[str, int]:
    """The modules over ``MAX_LINES`` (a smell alarm: split along a seam a reader would name,
    never by squeezing docstrings)."""
    return {path: n for path, n in sizes.items() if n > MAX_LINES}


def test_modules_over_the_size_alarm_are_reported():
    """An alarm, not a gate: a module over ``MAX_LINES`` is reported (a warning in the test
    summary) for a reader to look at; nothing fails, so nothing is split only to pass."""
    sizes = {
        str(path.relative_to(PACKAGE.parent)): len(path.read_text().splitlines())
        for path in PACKAGE.rglob("*.py")
    }
    assert sizes and all(n > 0 for n in sizes.values())
    over = oversized(sizes)
    if over:
        listed = ", ".join(f"{path} ({n} lines)" for path, n in sorted(over.items()))
        warnings.warn(f"modules over {MAX_LINES} lines, worth a look: {listed}", stacklevel=1)


def test_the_size_alarm_rings_for_a_planted_long_module():
    assert oversized({"megatron_offload/x.py": MAX_LINES + 1, "megatron_offload/y.py": 10}) == {
        "megatron_offload/x.py": MAX_LINES + 1
    }


def reaching_the_offloader(trees: dict[str, ast.Module]) -> list[str]:
    """Places in ``access/`` that reach the offloader: an import of ``offloader/`` or a name or
    attribute called ``offloader`` (the state access is handed what it uses, once)."""
    found = []
    for path, tree in trees.items():
        if not path.startswith("megatron_offload/access/"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and "offloader" in (node.module or "").split("."):
                found.append(f"{path}:{node.lineno}: import {node.module}")
            elif (isinstance(node, ast.Name) and node.id == "offloader") or (
                isinstance(node, ast.Attribute) and node.attr == "offloader"
            ):
                found.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_state_access_never_reaches_the_offloader():
    """``access/`` is handed the phase tracker, the members and the interceptions at attach;
    it neither imports the offloader nor calls back into it."""
    assert reaching_the_offloader(_modules()) == []


def test_the_offloader_scan_finds_planted_reaches():
    planted = {
        "megatron_offload/access/x.py": ast.parse(
            "from ..offloader.offloader import X\nself.offloader.phase\noffloader.wait()\n"
        ),
        "megatron_offload/offloader/y.py": ast.parse("offloader.wait()\n"),  # outside: fine
    }
    assert reaching_the_offloader(planted) == [
        "megatron_offload/access/x.py:1: import offloader.offloader",
        "megatron_offload/access/x.py:2: self.offloader",
        "megatron_offload/access/x.py:3: offloader",
    ]


# Plain attribute assignments to objects the package does not own that are not interceptions,
# and why each is none: (module, attribute) -> the reason.
ASSIGNED_BY_DESIGN = {
    ("megatron_offload/access/state.py", "state"): "the guarded state mapping, listed with "
    "Interceptions.record and an undo of its own (the optimizer writes into the mapping: the "
    "undo refills the original with what it holds now)",
    ("megatron_offload/access/dtensor_view.py", "data"): "a host view points the local "
    "tensors of Megatron-FSDP's released DTensors at the host copy (torch's Tensor.data setter, "
    "the objects stay, as megatron-core hands them out), and the released master buffers' "
    "data attribute at the host copy, and back when it closes, all or nothing",
    ("megatron_offload/adapters/megatron_fsdp.py", "param_groups"): "a load's states are made "
    "one parameter at a time: megatron-core's initializer runs over the inner optimizer's groups "
    "narrowed to that parameter, put back in a finally",
    ("megatron_offload/chunked/update.py", "param_groups"): "the chunked update points the "
    "inner optimizer at one chunk's groups for the length of its update call, on the step's "
    "path (a handle per chunk would cost there), and puts them back in a finally",
    ("megatron_offload/launch.py", "argv"): "the launcher hands the script it runs its own "
    "command line, as python -m does",
    ("megatron_offload/megatron/coexistence.py", "help"): "the help text of a flag this "
    "Megatron defines too, in the parser being built",
}


def _owned_attributes(trees: dict[str, ast.Module]) -> set[str]:
    """Attribute names a class of the package assigns through ``self`` or declares."""
    owned = set()
    for tree in trees.values():
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            owned.update(
                target.id
                for node in cls.body
                if isinstance(node, ast.Assign)
                for target in node.targets
                if isinstance(target, ast.Name)
            )
            for node in ast.walk(cls):
                if (
                    isinstance(node, ast.Attribute)
                    and isinstance(node.ctx, ast.Store)
                    and isinstance(node.value, ast.Name)
                    and node.value.id == "self"
                ):
                    owned.add(node.attr)
                elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                    owned.add(node.target.id)
    return owned


def _foreign_assignments(path: str, tree: ast.Module, owned: set[str]) -> list[str]:
    """``x.name = ...`` where ``x`` is not ``self`` nor an object made right there, ``name`` is
    no attribute of a class of ours nor a dunder, and ``x`` is not a function of the module:
    a change to an object the package does not own (``module.f = w``, ``inner.state = {}``,
    ``sys.excepthook = w``), which belongs in ``Interceptions`` (or ``ASSIGNED_BY_DESIGN``)."""
    functions = {
        node.name
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    }
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            continue
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        for target in (sub for t in targets for sub in ast.walk(t)):
            if not (isinstance(target, ast.Attribute) and isinstance(target.ctx, ast.Store)):
                continue
            base, name = target.value, target.attr
            if (
                (
                    isinstance(base, ast.Name)
                    and (base.id in ("self", "cls") or base.id in functions)
                )
                or isinstance(base, ast.Call)
                or name in owned
                or (name.startswith("__") and name.endswith("__"))
                or (path, name) in ASSIGNED_BY_DESIGN
            ):
                continue
            found.append(f"{path}:{node.lineno}: {ast.unparse(target)} =")
    return found


def changes_by_hand(trees: dict[str, ast.Module]) -> list[str]:
    """Changes made to objects outside ``interceptions.py``: an instance's or a module's
    dictionary written (``vars(x)[...] =``, ``x.__dict__[...] =``, ``vars(x).pop``), a
    function replaced by ``setattr`` (but a mark on a function of ours, or a class of the same
    module being built), an attribute of an object the package does not own assigned
    (``_foreign_assignments``), or a torch
    hook registered whose handle is not handed to ``Interceptions.hook`` at once. The
    process-wide installs (``patch_megatron``, the frameworks') are scanned too."""
    found = []
    owned = _owned_attributes(_modules())
    for path, tree in trees.items():
        # The re-pointing component sets tensors, not functions (its own rule is below).
        if path.endswith(("interceptions.py", "adapters/holders.py")):
            continue
        found += _foreign_assignments(path, tree, owned)
        classes = {node.name for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}
        handed = {
            id(node.args[0])
            for node in ast.walk(tree)
            if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("hook", "_hook")  # the guard's helper hands it on
            and node.args
        }
        for node in ast.walk(tree):
            text = ast.unparse(node)
            if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store):
                if text.startswith("vars(") or ".__dict__[" in text:
                    found.append(f"{path}:{node.lineno}: {text}")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                name = node.func.attr
                if name == "pop" and (text.startswith("vars(") or ".__dict__.pop" in text):
                    found.append(f"{path}:{node.lineno}: {text}")
                elif name.startswith("register_") and name.endswith("hook"):
                    if id(node) not in handed and "offload_" not in name:
                        found.append(f"{path}:{node.lineno}: {text}")
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "setattr"
                and len(node.args) == 3
                and not (isinstance(node.args[1], ast.Name) and node.args[1].id.endswith("MARK"))
                and not (isinstance(node.args[0], ast.Name) and node.args[0].id in classes)
            ):
                found.append(f"{path}:{node.lineno}: {text}")
    return found


def test_every_change_to_an_optimizer_goes_through_interceptions():
    assert changes_by_hand(_modules()) == []


def test_the_interception_scan_finds_planted_changes():
    planted = {
        "megatron_offload/chunked/x.py": ast.parse(
            "def f(obj, inner, installed):\n"
            "    vars(obj)['step'] = 1\n"
            "    obj.__dict__['step'] = 1\n"
            "    vars(obj).pop('step')\n"
            "    inner.register_step_pre_hook(f)\n"
            "    installed.hook(inner.register_step_pre_hook(f), where='', why='')\n"
        ),
        "megatron_offload/interceptions.py": ast.parse("def g(obj):\n    vars(obj)['x'] = 1\n"),
        "megatron_offload/frameworks/y.py": ast.parse(
            "def h(module, cls, wrapper):\n"
            "    setattr(module, 'train', wrapper)\n"
            "    setattr(wrapper, _MARK, True)\n"
            "    vars(module)['train'] = wrapper\n"
        ),
        # Plain assignments: to a module's function, an optimizer's mapping, the process's
        # hook; and what stays allowed (our own object, a dunder, an object made right there).
        "megatron_offload/megatron/z.py": ast.parse(
            "import sys\n"
            "def k(module, inner, w, piece):\n"
            "    module.finalize_model_grads = w\n"
            "    inner.state = {}\n"
            "    sys.excepthook = w\n"
            "    piece.place = None\n"
            "    w.__wrapped__ = k\n"
            "    make().atexit = False\n"
        ),
    }
    found = [":".join(line.split(":")[:2]) for line in changes_by_hand(planted)]
    assert found == [
        "megatron_offload/chunked/x.py:2",
        "megatron_offload/chunked/x.py:3",
        "megatron_offload/chunked/x.py:4",
        "megatron_offload/chunked/x.py:5",
        "megatron_offload/frameworks/y.py:2",
        "megatron_offload/frameworks/y.py:4",
        "megatron_offload/megatron/z.py:3",
        "megatron_offload/megatron/z.py:4",
        "megatron_offload/megatron/z.py:5",
    ], found


def test_one_component_repoints_the_optimizers_tensors():
    """Host views, the chunked update and the state watch point the optimizer at other tensors
    (and back) through ``adapters.holders`` alone: none assigns into a state entry, a param
    group's list or a quantized state's attribute by itself."""
    users = {
        "megatron_offload/access/host_view.py",
        "megatron_offload/chunked/update.py",
        "megatron_offload/adapters/megatron_wrappers.py",
    }
    trees = _modules()
    for path in users:
        imported = {
            alias.name
            for node in ast.walk(trees[path])
            if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("holders")
            for alias in node.names
        }
        assert imported & {"Repointing", "Holder"}, path
        for node in ast.walk(trees[path]):
            assert not (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "setattr"
            ), f"{path}:{node.lineno}: setattr"
