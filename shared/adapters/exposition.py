"""The Prometheus exposition format as dcgm-exporter writes it: which series count, who a series is about, and
``ExpositionParser``, which turns a page into readings.

Exposition text is validated by prometheus-client's parser. A node's page repeats the same few label sets in every
scrape, so ``ExpositionParser`` hands each line whose label set (and metric name) it has not seen yet to that
parser, and afterwards only parses the value of a known shape; and a page laid out exactly as its source's last
clean page (same lines, same label sets, only the numbers differ) is read by that page's plan in one pass. The
reference parser costs about 8 ms per 8-GPU page (8 CPU seconds per second at 1,000 nodes, against a budget of
half a core), this well under 0.1 ms. A property test holds the fast paths to prometheus-client's own reading of
every page (tests/test_http_client.py). ``engine="reference"`` runs the whole page through prometheus-client
instead. Either way, a malformed line is reported and skipped; the rest is used.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Literal

from prometheus_client.parser import text_string_to_metric_families

from shared.ports.metrics import GpuReading, SourceRead

# dcgm-exporter series -> reading field. Counters arrive from prometheus-client's parser with ``_total`` added.
FIELD_OF: dict[str, str] = {
    "DCGM_FI_DEV_GPU_UTIL": "gpu_util",
    "DCGM_FI_DEV_MEM_COPY_UTIL": "mem_copy_util",
    "DCGM_FI_DEV_FB_USED": "mem_used_mib",
    "DCGM_FI_DEV_FB_FREE": "mem_free_mib",
    "DCGM_FI_DEV_FB_RESERVED": "mem_reserved_mib",
    "DCGM_FI_DEV_POWER_USAGE": "power_w",
    "DCGM_FI_DEV_GPU_TEMP": "temperature_c",
    "DCGM_FI_DEV_XID_ERRORS": "xid",
    "DCGM_FI_PROF_GR_ENGINE_ACTIVE": "gr_engine_active",
    "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": "energy_mj",
    "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION_total": "energy_mj",
}
SERIES_NAMES: tuple[str, ...] = tuple(n for n in FIELD_OF if not n.endswith("_total"))

# label -> position in ``Identity``; old and new spellings of the same label share a position.
_LABEL_SLOT: dict[str, int] = {
    "UUID": 0,
    "gpu": 1,
    "Hostname": 2,
    "hostname": 2,
    "modelName": 3,
    "GPU_I_PROFILE": 4,
    "GPU_I_ID": 5,
    "pod": 6,
    "pod_name": 6,
    "namespace": 7,
    "pod_namespace": 7,
    "container": 8,
    "container_name": 8,
}
Identity = tuple[str, str, str, str, str, str, str, str, str]
"""(uuid, gpu index, node, model, MIG profile, GPU instance id, pod, namespace, container)."""


def identity(labels: Mapping[str, str]) -> Identity:
    """Who a series is about, accepting both ``Hostname``/``hostname`` and the old ``pod_name``/``pod_namespace``/
    ``container_name`` spellings (the new one wins when both are present)."""
    slots = ["", "", "", "", "", "", "", "", ""]
    for name, value in labels.items():
        slot = _LABEL_SLOT.get(name)
        if slot is not None and value and (not slots[slot] or name in ("Hostname", "pod", "namespace", "container")):
            slots[slot] = value
    return tuple(slots)  # type: ignore[return-value]


class ReadingsBuilder:
    """Collects samples into readings keyed by (uuid, GPU instance)."""

    __slots__ = ("by_key", "problems", "series")

    def __init__(self) -> None:
        self.by_key: dict[tuple[str, str], GpuReading] = {}
        self.problems: list[str] = []
        self.series = 0

    def add(self, name: str, ident: Identity, value: float, timestamp: float | None) -> None:
        self.series += 1
        slot = FIELD_OF.get(name)
        if slot is None:
            return
        if not ident[0]:
            self.problems.append(f"{name}: a series without a UUID label (skipped)")
            return
        key = (ident[0], ident[5])
        reading = self.by_key.get(key)
        if reading is None:
            reading = self.by_key[key] = GpuReading(*ident)
        if value != value or value in (math.inf, -math.inf):
            reading.invalid.append(slot)
            self.problems.append(f"{name}{{UUID={ident[0]!r}}}: {value} (not used)")
            return
        reading.values[slot] = float(value)
        if timestamp is not None and (reading.timestamp is None or timestamp > reading.timestamp):
            reading.timestamp = timestamp

    def readings(self) -> list[GpuReading]:
        return list(self.by_key.values())


def _reference_samples(text: str) -> Iterator[tuple[str, dict[str, str], float, float | None]]:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            yield s.name, s.labels, s.value, None if s.timestamp is None else float(s.timestamp)


def _lines_with_types(text: str) -> Iterator[tuple[int, str, str]]:
    """(line number, line, the ``# TYPE`` line of its family or "") for every sample line."""
    type_line: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line:
            continue
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) >= 4 and parts[1] == "TYPE":
                type_line[parts[2]] = line
            continue
        brace = line.find("{")
        name = line[:brace] if brace >= 0 else line.split(None, 1)[0]
        yield number, line, type_line.get(name, "")


def _bad_line(number: int, line: str, exc: Exception) -> str:
    shown = line if len(line) <= 160 else line[:157] + "..."
    reason = str(exc) or type(exc).__name__
    return f"line {number}: malformed, skipped: {shown!r} ({reason[:120]})"


# The number after a labelled sample's closing brace, to the end of the line: no '}', '_', space (a timestamp) or
# newline in it. A line whose tail has any of those does not match and so stays in the skeleton.
_VALUE_RE = re.compile(r"\} ([^\n}_ ]*)$", re.MULTILINE)


@dataclass(slots=True)
class _PagePlan:
    """One source's page layout: the page's text between the samples' numbers (``skeleton``), and for each number in
    order whether it is used (``used``: its position among the ``count`` numbers) and where it goes (``targets``:
    the reading's index and field)."""

    skeleton: str
    count: int
    used: list[int]
    targets: list[tuple[int, str]]
    identities: list[Identity]
    series: int

    def read(self, text: str) -> list[GpuReading] | None:
        """The page's readings, or None when it is not laid out as planned or a number is not a finite float."""
        parts = _VALUE_RE.split(text)  # text, number, text, number, ..., text: one pass over the page
        numbers = parts[1::2]
        if len(numbers) != self.count or "".join(parts[0::2]) != self.skeleton:
            return None
        try:
            values = [float(numbers[i]) for i in self.used]
        except ValueError:
            return None
        if not all(map(math.isfinite, values)):
            return None
        readings = [GpuReading(*identity) for identity in self.identities]
        for (reading, slot), value in zip(self.targets, values, strict=True):
            readings[reading].values[slot] = value
        return readings


class ExpositionParser:
    """Turns exporter pages into readings. Keep one per source: it remembers each series (name and label set)
    it has validated, at most ``max_shapes`` of them (about 200 per 8-GPU node; the memory is dropped when
    full)."""

    def __init__(
        self, engine: Literal["cached", "reference"] = "cached", max_shapes: int = 1_000_000, max_pages: int = 16_384
    ) -> None:
        self.engine = engine
        self.max_shapes = max_shapes
        self.max_pages = max_pages
        self._shapes: dict[str, tuple[str | None, str, Identity, tuple[str, str]]] = {}
        self._pages: dict[str, _PagePlan] = {}

    def parse(self, text: str, source: str = "", read_at: float | None = None) -> SourceRead:
        """With a ``source`` named, a page laid out exactly as that source's last clean page (same lines, same
        label sets, only the numbers differ: the usual case for an exporter) is read by its plan, without
        looking at a line; anything else is parsed line by line, and a clean page becomes the new plan."""
        read_at = time.time() if read_at is None else read_at
        if self.engine == "cached" and source:
            plan = self._pages.get(source)
            if plan is not None:
                readings = plan.read(text)
                if readings is not None:
                    return SourceRead(source=source, readings=readings, series=plan.series, read_at=read_at)
        builder = ReadingsBuilder()
        if self.engine == "reference":
            self._parse_reference(text, builder)
        else:
            self._parse_cached(text, builder)
            if source:
                self._plan(source, text, builder)
        return SourceRead(
            source=source,
            readings=builder.readings(),
            problems=builder.problems,
            series=builder.series,
            read_at=read_at,
        )

    def _plan(self, source: str, text: str, builder: ReadingsBuilder) -> None:
        """Remember where each number of this page goes, if the page was clean (no problem, no timestamp)."""
        self._pages.pop(source, None)
        if builder.problems or any(r.timestamp is not None for r in builder.by_key.values()):
            return
        index = {key: i for i, key in enumerate(builder.by_key)}
        targets: list[tuple[int, str] | None] = []
        for match in _VALUE_RE.finditer(text):
            head = text[text.rfind("\n", 0, match.start()) + 1 : match.start()]
            if head.startswith("#"):
                targets.append(None)
                continue
            shape = self._shapes.get(head)
            if shape is None:
                return
            slot, _, _, key = shape
            targets.append(None if slot is None else (index[key], slot))
        if len(self._pages) >= self.max_pages:
            self._pages.clear()
        self._pages[source] = _PagePlan(
            skeleton="".join(_VALUE_RE.split(text)[0::2]),
            count=len(targets),
            used=[i for i, t in enumerate(targets) if t is not None],
            targets=[t for t in targets if t is not None],
            identities=[
                (r.uuid, r.gpu, r.node, r.model, r.mig_profile, r.gpu_instance_id, r.pod, r.namespace, r.container)
                for r in builder.by_key.values()
            ],
            series=builder.series,
        )

    @staticmethod
    def _parse_reference(text: str, builder: ReadingsBuilder) -> None:
        try:
            samples = list(_reference_samples(text))
        except ValueError:
            samples = []
            for number, line, type_line in _lines_with_types(text):
                try:
                    samples.extend(_reference_samples(f"{type_line}\n{line}\n" if type_line else line + "\n"))
                except ValueError as exc:
                    builder.problems.append(_bad_line(number, line, exc))
        for name, labels, value, timestamp in samples:
            builder.add(name, identity(labels), value, timestamp)

    def _learn(self, line: str) -> tuple[str, dict[str, str], float, float | None]:
        """Validate one sample line with prometheus-client's parser and remember its name and label set."""
        found = list(_reference_samples(line + "\n"))
        if len(found) != 1:
            raise ValueError("not one sample")
        name, labels, value, timestamp = found[0]
        return name, labels, value, timestamp

    def _parse_cached(self, text: str, builder: ReadingsBuilder) -> None:
        shapes = self._shapes
        if len(shapes) > self.max_shapes:
            shapes.clear()
        by_key = builder.by_key
        problems = builder.problems
        series = 0
        for number, line in enumerate(text.split("\n"), start=1):
            if not line or line[0] == "#":
                continue
            head, sep, rest = line.rpartition("} ")
            shape = shapes.get(head) if sep else None
            if shape is None:
                if line.isspace():
                    continue
                try:
                    name, labels, value, timestamp = self._learn(line)
                except ValueError as exc:
                    problems.append(_bad_line(number, line, exc))
                    continue
                ident = identity(labels)
                if sep:
                    shapes[head] = (FIELD_OF.get(name), name, ident, (ident[0], ident[5]))
                builder.add(name, ident, float(value), timestamp)
                continue
            slot, name, ident, key = shape
            try:
                if "_" in rest:
                    raise ValueError("'_' in a value")
                if " " in rest.strip():
                    value_text, _, stamp_text = rest.strip().partition(" ")
                    value, timestamp = float(value_text), float(stamp_text) / 1000.0
                else:
                    value, timestamp = float(rest), None
            except ValueError as exc:
                problems.append(_bad_line(number, line, exc))
                continue
            series += 1
            if slot is None:
                continue
            if not key[0] or value != value or value in (math.inf, -math.inf):
                series -= 1
                builder.add(name, ident, value, timestamp)
                continue
            reading = by_key.get(key)
            if reading is None:
                reading = by_key[key] = GpuReading(*ident)
            reading.values[slot] = value
            if timestamp is not None and (reading.timestamp is None or timestamp > reading.timestamp):
                reading.timestamp = timestamp
        builder.series += series
