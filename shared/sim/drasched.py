"""The simulated scheduler's side of DRA: which devices of the ResourceSlices a ResourceClaim gets.

A claim's requests name a DeviceClass and may narrow it with CEL selectors, as `resource.k8s.io/v1` says. This
module evaluates the forms claims and classes use in practice, not all of CEL:

- ``device.driver == "gpu.gpuwarden.io"`` (and ``!=``);
- ``device.attributes["gpu.gpuwarden.io"].productName == "NVIDIA H100 80GB HBM3"``: equality and inequality on an
  attribute (string, int, bool), order comparisons on int attributes;
- ``device.capacity["gpu.gpuwarden.io"].memory.compareTo(quantity("40Gi")) >= 0``, or the shorter
  ``device.capacity["gpu.gpuwarden.io"].memory >= quantity("40Gi")``: any comparison of a capacity with a quantity;
- ``&&``, ``||``, ``!`` and parentheses.

Anything else is a ``SelectorError`` naming the expression and where it stopped, never a guess. An attribute or
capacity a device does not have is missing: the device is not selected (never compared as 0 or ""). A device
tainted ``NoSchedule`` or ``NoExecute`` is allocated only to a request that tolerates the taint's key. A claim's
devices all come from one node (its pod's); every request is met or nothing is allocated. SIMULATED: the real
scheduler is Kubernetes'.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

from shared.ports.cluster import AllocatedDevice, ResourceSlice, Semver, SliceDevice


class SelectorError(ValueError):
    """A CEL expression this simulation cannot evaluate (or that is not CEL at all)."""


class Unschedulable(Exception):
    """No node offers every request of the claim; the message says what each request found."""


_SUFFIXES: dict[str, Decimal] = {
    "Ki": Decimal(2**10),
    "Mi": Decimal(2**20),
    "Gi": Decimal(2**30),
    "Ti": Decimal(2**40),
    "Pi": Decimal(2**50),
    "k": Decimal(10**3),
    "M": Decimal(10**6),
    "G": Decimal(10**9),
    "T": Decimal(10**12),
    "P": Decimal(10**15),
    "m": Decimal("0.001"),
    "": Decimal(1),
}
_QUANTITY = re.compile(r"^([+-]?[0-9]+(?:\.[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|k|M|G|T|P|m)?$")


def parse_quantity(text: str) -> Decimal:
    """A Kubernetes quantity (``81559Mi``, ``40Gi``, ``16``, ``500m``) as a number; ``SelectorError`` otherwise."""
    match = _QUANTITY.match(text.strip())
    if match is None:
        raise SelectorError(f"not a Kubernetes quantity: {text!r}")
    try:
        return Decimal(match.group(1)) * _SUFFIXES[match.group(2) or ""]
    except InvalidOperation as exc:  # pragma: no cover - the pattern admits only numbers
        raise SelectorError(f"not a Kubernetes quantity: {text!r}") from exc


_TOKEN = re.compile(
    r"""\s*(?:
        (?P<string>"(?:[^"\\]|\\.)*")
      | (?P<number>-?[0-9]+)
      | (?P<op>&&|\|\||==|!=|>=|<=|>|<|!|\(|\)|\[|\]|\.|,)
      | (?P<name>[A-Za-z_][A-Za-z0-9_]*)
    )""",
    re.VERBOSE,
)

_Value = str | int | bool | Decimal | Semver | None
"""What an operand evaluates to; None: the device does not have it (missing)."""


@dataclass(frozen=True, slots=True)
class _Operand:
    kind: str  # "driver", "attribute", "capacity", "literal"
    domain: str = ""
    name: str = ""
    literal: _Value = None

    def value(self, driver: str, device: SliceDevice) -> _Value:
        if self.kind == "driver":
            return driver
        if self.kind == "literal":
            return self.literal
        qualified = device.attributes if self.kind == "attribute" else device.capacity
        # a name is the device's own when its domain is the driver's (``gpu.gpuwarden.io/memory`` or ``memory``)
        found = qualified.get(f"{self.domain}/{self.name}") if self.domain != driver else None
        if found is None and self.domain == driver:
            found = qualified.get(self.name)
        if found is None:
            return None
        if self.kind == "capacity":
            return parse_quantity(str(found))
        return found


@dataclass(frozen=True, slots=True)
class _Compare:
    left: _Operand
    op: str
    right: _Operand

    def holds(self, driver: str, device: SliceDevice) -> bool:
        a, b = self.left.value(driver, device), self.right.value(driver, device)
        if a is None or b is None:
            return False
        if isinstance(a, Semver) or isinstance(b, Semver):
            return _order(_semver(a), self.op, _semver(b))
        if isinstance(a, bool) != isinstance(b, bool) or isinstance(a, str) != isinstance(b, str):
            return False  # a type mismatch selects nothing (CEL: no such overload)
        if self.op == "==":
            return a == b
        if self.op == "!=":
            return a != b
        if isinstance(a, (str, bool)) or not isinstance(a, (int, Decimal)) or not isinstance(b, (int, Decimal)):
            return False  # strings and bools have no order here
        return _order(a, self.op, b)


def _order(a: Any, op: str, b: Any) -> bool:
    return {"==": a == b, "!=": a != b, ">=": a >= b, ">": a > b, "<=": a <= b, "<": a < b}[op]


def _semver(value: _Value) -> tuple[int, ...]:
    text = value.value if isinstance(value, Semver) else str(value)
    return tuple(int(p) for p in re.findall(r"[0-9]+", text)[:3])


@dataclass(frozen=True, slots=True)
class _Not:
    inner: _Node

    def holds(self, driver: str, device: SliceDevice) -> bool:
        return not self.inner.holds(driver, device)


@dataclass(frozen=True, slots=True)
class _Both:
    parts: tuple[_Node, ...]
    any: bool

    def holds(self, driver: str, device: SliceDevice) -> bool:
        results = (p.holds(driver, device) for p in self.parts)
        return any(results) if self.any else all(results)


_Node = _Compare | _Not | _Both


class _Parser:
    def __init__(self, expression: str) -> None:
        self.expression = expression
        self.tokens: list[tuple[str, str]] = []
        position = 0
        text = expression.rstrip()
        while position < len(text):
            match = _TOKEN.match(text, position)
            if match is None or match.end() == position:
                raise self.error(f"unexpected {text[position : position + 12]!r}")
            kind = match.lastgroup or ""
            self.tokens.append((kind, match.group(kind)))
            position = match.end()
        self.at = 0

    def error(self, why: str) -> SelectorError:
        return SelectorError(
            f"CEL selector {self.expression!r}: {why} (the simulation evaluates the forms docs/devices.md lists)"
        )

    def peek(self) -> str:
        return self.tokens[self.at][1] if self.at < len(self.tokens) else ""

    def take(self, expected: str | None = None) -> tuple[str, str]:
        if self.at >= len(self.tokens):
            raise self.error(f"ends early{f', expected {expected!r}' if expected else ''}")
        token = self.tokens[self.at]
        if expected is not None and token[1] != expected:
            raise self.error(f"expected {expected!r}, found {token[1]!r}")
        self.at += 1
        return token

    def parse(self) -> _Node:
        node = self.disjunction()
        if self.at != len(self.tokens):
            raise self.error(f"unexpected {self.peek()!r}")
        return node

    def disjunction(self) -> _Node:
        parts = [self.conjunction()]
        while self.peek() == "||":
            self.take()
            parts.append(self.conjunction())
        return parts[0] if len(parts) == 1 else _Both(tuple(parts), any=True)

    def conjunction(self) -> _Node:
        parts = [self.unary()]
        while self.peek() == "&&":
            self.take()
            parts.append(self.unary())
        return parts[0] if len(parts) == 1 else _Both(tuple(parts), any=False)

    def unary(self) -> _Node:
        if self.peek() == "!":
            self.take()
            return _Not(self.unary())
        if self.peek() == "(":
            self.take()
            inner = self.disjunction()
            self.take(")")
            return inner
        return self.comparison()

    def comparison(self) -> _Node:
        left, compared = self.operand()
        if compared is not None:  # x.compareTo(quantity(...)) OP 0
            op = self.take()[1]
            zero = self.take()
            if op not in ("==", "!=", ">=", ">", "<=", "<") or zero != ("number", "0"):
                raise self.error("compareTo(...) is compared with 0")
            return _Compare(left, op, compared)
        op = self.take()[1]
        if op not in ("==", "!=", ">=", ">", "<=", "<"):
            raise self.error(f"expected a comparison, found {op!r}")
        right, again = self.operand()
        if again is not None:
            raise self.error("compareTo on the right-hand side")
        return _Compare(left, op, right)

    def operand(self) -> tuple[_Operand, _Operand | None]:
        kind, text = self.take()
        if kind == "string":
            return _Operand("literal", literal=_unquote(text)), None
        if kind == "number":
            return _Operand("literal", literal=int(text)), None
        if kind != "name":
            raise self.error(f"unexpected {text!r}")
        if text in ("true", "false"):
            return _Operand("literal", literal=text == "true"), None
        if text in ("quantity", "semver"):
            self.take("(")
            kind, value = self.take()
            self.take(")")
            if kind != "string":
                raise self.error(f"{text}() takes a string")
            literal = parse_quantity(_unquote(value)) if text == "quantity" else Semver(_unquote(value))
            return _Operand("literal", literal=literal), None
        if text != "device":
            raise self.error(f"unknown name {text!r}")
        self.take(".")
        field = self.take()[1]
        if field == "driver":
            return _Operand("driver"), None
        if field not in ("attributes", "capacity"):
            raise self.error(f"device.{field} is not evaluated here")
        self.take("[")
        kind, domain = self.take()
        if kind != "string":
            raise self.error(f"device.{field}[...] takes a domain string")
        self.take("]")
        self.take(".")
        kind, name = self.take()
        if kind != "name":
            raise self.error(f"expected a name after device.{field}[...], found {name!r}")
        operand = _Operand("attribute" if field == "attributes" else "capacity", _unquote(domain), name)
        if self.peek() == ".":
            self.take(".")
            self.take("compareTo")
            self.take("(")
            other, _ = self.operand()
            self.take(")")
            return operand, other
        return operand, None


def _unquote(text: str) -> str:
    return re.sub(r"\\(.)", r"\1", text[1:-1])


@dataclass(frozen=True, slots=True)
class Selector:
    """One CEL selector, parsed once."""

    expression: str
    _node: _Node

    @classmethod
    def parse(cls, expression: str) -> Selector:
        return cls(expression, _Parser(expression).parse())

    def selects(self, driver: str, device: SliceDevice) -> bool:
        return self._node.holds(driver, device)


@dataclass(frozen=True, slots=True)
class DeviceRequest:
    """One request of a claim (``spec.devices.requests[].exactly``): ``count`` devices of ``device_class`` that
    every selector selects (``all_devices``: every such device of the node, at least one); ``tolerates``: taint
    keys it tolerates."""

    name: str
    device_class: str
    selectors: tuple[Selector, ...] = ()
    count: int = 1
    all_devices: bool = False
    tolerates: tuple[str, ...] = ()


DEVICE_CLASSES: Mapping[str, tuple[Selector, ...]] = {
    "gpu.gpuwarden.io": (
        Selector.parse('device.driver == "gpu.gpuwarden.io" && device.attributes["gpu.gpuwarden.io"].type == "gpu"'),
    ),
    "mig.gpuwarden.io": (
        Selector.parse('device.driver == "gpu.gpuwarden.io" && device.attributes["gpu.gpuwarden.io"].type == "mig"'),
    ),
}
"""The DeviceClasses of deploy/dra/deviceclasses.yaml (a test keeps the two the same)."""

Taken = set[tuple[str, str, str]]
"""Devices allocated to claims already, as (driver, pool, device)."""


def allocate(
    requests: Iterable[DeviceRequest],
    slices: Iterable[ResourceSlice],
    taken: Taken,
    classes: Mapping[str, tuple[Selector, ...]] = DEVICE_CLASSES,
    node: str | None = None,
) -> tuple[str, tuple[AllocatedDevice, ...]]:
    """The node and devices a claim gets: the first node (by name; ``node`` only, when the pod's is known) where
    every request is met by free devices its class and selectors select and whose taints it tolerates. Devices are
    taken in the slice's order. ``Unschedulable`` when no node can, saying what each request found."""
    wanted = list(requests)
    for request in wanted:
        if request.device_class not in classes:
            raise Unschedulable(f"request {request.name!r}: no DeviceClass {request.device_class!r}")
        if request.count < 1 and not request.all_devices:
            raise Unschedulable(f"request {request.name!r}: count {request.count} (at least 1)")
    by_node: dict[str, list[ResourceSlice]] = {}
    for resource_slice in slices:
        if node is None or resource_slice.node == node:
            by_node.setdefault(resource_slice.node, []).append(resource_slice)
    found: dict[str, list[str]] = {r.name: [] for r in wanted}
    for name in sorted(by_node):
        chosen: list[AllocatedDevice] = []
        used: Taken = set()
        for request in wanted:
            fits = [
                (s, d)
                for s in by_node[name]
                for d in s.devices
                if (s.driver, s.pool, d.name) not in taken
                and (s.driver, s.pool, d.name) not in used
                and _eligible(request, s.driver, d, classes)
            ]
            found[request.name].append(f"{name}: {len(fits)}")
            need = len(fits) if request.all_devices else request.count
            if not fits or len(fits) < need:
                break
            for s, d in fits[:need]:
                used.add((s.driver, s.pool, d.name))
                chosen.append(AllocatedDevice(request=request.name, driver=s.driver, pool=s.pool, device=d.name))
        else:
            return name, tuple(chosen)
    where = "; ".join(f"{r}: {', '.join(v) or 'no node'}" for r, v in found.items())
    raise Unschedulable(f"no node meets every request (free devices selected per node: {where})")


def _eligible(
    request: DeviceRequest, driver: str, device: SliceDevice, classes: Mapping[str, tuple[Selector, ...]]
) -> bool:
    for taint in device.taints:
        if taint.effect in ("NoSchedule", "NoExecute") and taint.key not in request.tolerates:
            return False
    return all(s.selects(driver, device) for s in (*classes[request.device_class], *request.selectors))
