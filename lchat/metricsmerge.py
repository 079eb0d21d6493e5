"""One Prometheus scrape for a box of many processes: the control process's own registry merged
with its data-plane workers' ``/metrics`` text (docs/performance.md "Many cores").

Pure: no clock, no I/O. The control process scrapes its workers (``lchat.workerchannel.ask``), hands
each answer to :meth:`MergedMetrics.update`, tells :meth:`MergedMetrics.ended` when a worker's run
ends or its scrape fails (``update(slot, None)``), and renders
``prometheus_client.generate_latest(merged)``.

The rules, by family (names as the text format's parser gives them: a counter without ``_total``):

- **Summed** (:data:`SUMMED_PREFIXES`, :data:`SUMMED`): the data plane's figures. Each worker's
  samples are added to control's own, series by series; a series only the workers have is emitted
  from theirs alone.
- Worker samples of ``lchat_http_requests{host_class="hop"}`` are **dropped**: a request a worker
  handed to control over the hop is counted again, with its true labels, by control's hop door.
- **Per worker** (:data:`PER_WORKER_PREFIXES`, ``process_*``, ``python_gc_*``): a worker's samples
  get a ``worker="<slot>"`` label; control's own stay unlabelled (distinct series, one family).
- **Every other worker family is dropped**: control's values are the box's (routes, certificates,
  registry reloads, ...).

Invariants:

- A summed counter (and a histogram's or summary's counts and sums) never goes down across a
  worker's restart: each slot keeps the last value seen of every such sample of its current run,
  and a run that ends (:meth:`MergedMetrics.ended`, or a new ``process_start_time_seconds``: a
  restart nobody reported) moves those values into the slot's carried base. An answer of the
  same run with a counter lower than already seen is an older scrape overtaken by a newer one,
  and is ignored (without the process figures, a counter going down is taken as a restart). The box's value is control's + Σ over slots (carried + last seen).
- A worker whose last scrape failed (``update(slot, None)``: it did not answer in time) still
  contributes its last-seen counters (no dip, no false reset) but none of its gauges and none of
  its per-worker series (stale figures of a process that may be gone would mislead).
- Collecting changes nothing: two scrapes rendered at once (Prometheus and an operator's ``curl``)
  each get the whole box.
- No family is emitted twice: worker samples join control's family of the same name. A worker's
  ``_created`` samples (creation times, which do not add up) are dropped; control's are kept.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from attrs import define, field
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

# Families summed over the processes: the data plane's, which every worker serves a share of.
SUMMED_PREFIXES = ("lchat_http_", "lchat_proxy_", "lchat_upstream_")
SUMMED = frozenset(
    {
        "lchat_upgraded_connections",
        "lchat_tls_handshake_failures",
        "lchat_tls_held_handshakes",
        "lchat_tls_holds",
        "lchat_tls_silent_connections",
        "lchat_tls_handshakes",
        # The control channel's own figures (lchat.workerchannel), counted on both sides: the
        # ``call`` label says which side's calls failed.
        "lchat_worker_channel_failures",
        "lchat_worker_cert_wanted",
    }
)
PER_WORKER_PREFIXES = ("process_", "python_gc_")
WORKER_LABEL = "worker"
# (family, label, value) of worker samples counted again elsewhere: dropped from workers' figures.
DROPPED_ROWS = (("lchat_http_requests", "host_class", "hop"),)

# Types whose samples only grow during one process's run (a histogram's buckets, count and sum).
COUNTING = frozenset({"counter", "histogram", "summary"})
START_TIME = "process_start_time_seconds"
_ENDED_RUNS_KEPT = 8  # start times of a slot's ended runs remembered, to ignore their late answers

Labels = tuple[tuple[str, str], ...]  # sorted
SampleKey = tuple[str, Labels]  # (sample name, labels)


class MetricsTextError(ValueError):
    """A worker's ``/metrics`` answer is not Prometheus text: the slot keeps its earlier figures
    and counts as not having answered this round."""


@define
class _Family:
    type: str
    documentation: str
    unit: str
    samples: dict[SampleKey, float] = field(factory=dict)


@define
class _Slot:
    """One worker slot's figures: its current run's last scrape and the counters of runs past."""

    last: dict[str, _Family] = field(factory=dict)  # summed and per-worker families, last scrape
    carried: dict[str, _Family] = field(factory=dict)  # counting families of ended runs, summed
    fresh: bool = False  # its last scrape answered
    started: float | None = None  # its current run's process_start_time_seconds
    ended_runs: list[float] = field(factory=list)  # start times of runs that ended


def summed(family: str) -> bool:
    """``family`` (a parsed family name) is one of the data plane's, added up over processes."""
    return family in SUMMED or family.startswith(SUMMED_PREFIXES)


def per_worker(family: str) -> bool:
    """``family`` is a process's own (memory, CPU, GC), kept apart by a ``worker`` label."""
    return family.startswith(PER_WORKER_PREFIXES)


class MergedMetrics(Collector):
    """A Prometheus collector (``generate_latest(merged)``) for the whole box: ``own_registry``
    (control's registry, or any collector) with its workers' figures merged in by the rules
    above. Not registered in ``own_registry`` itself (it would collect itself)."""

    def __init__(self, own_registry: Collector) -> None:
        self._own = own_registry
        self._slots: dict[int, _Slot] = {}

    def update(self, slot: int, text: str | bytes | None) -> None:
        """Worker ``slot`` answered a scrape with ``text`` (its ``/metrics`` body), or did not
        answer it (``None``: its gauges go until it answers again, its counters stay).

        Raises :class:`MetricsTextError` (the slot then counts as not answering) if ``text`` is
        not Prometheus text. An answer from a run already ended is ignored (a late scrape)."""
        if text is None:
            if slot in self._slots:
                self._slots[slot].fresh = False
            return
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        try:
            families = _kept(text_string_to_metric_families(text))
        except (ValueError, TypeError, IndexError, KeyError) as e:
            self.update(slot, None)
            raise MetricsTextError(
                f"worker {slot}: its metrics are not Prometheus text: {e}"
            ) from e
        state = self._slots.setdefault(slot, _Slot())
        started = _start_time(families)
        if started is not None and started in state.ended_runs:
            return
        if started is not None and started == state.started:
            if _went_down(state.last, families):
                return  # an older answer of this run, overtaken by a newer one (two scrapes)
        elif state.started is not None or _went_down(state.last, families):
            # A new run nobody reported: its start time changed, or (a platform without the
            # process figures) a counter went down.
            self._carry(state)
        state.last = families
        state.started = started
        state.fresh = True

    def ended(self, slot: int) -> None:
        """Worker ``slot``'s run ended (it exited, was killed or is being replaced): its counters
        become the slot's carried base, its gauges and per-worker series go."""
        state = self._slots.get(slot)
        if state is not None:
            self._carry(state)

    def collect(self) -> Iterator[Metric]:
        """Control's families with the workers' merged in, then the workers' families control
        lacks."""
        merged: dict[str, _Family] = {}
        own: dict[str, Metric] = {}
        for metric in self._own.collect():
            own[metric.name] = metric
        for slot, state in sorted(self._slots.items()):
            for name, family in state.carried.items():
                _add(merged, own, name, family, ())
            for name, family in state.last.items():
                if per_worker(name):
                    if state.fresh:
                        _add(merged, own, name, family, ((WORKER_LABEL, str(slot)),))
                elif family.type in COUNTING:
                    _add(merged, own, name, family, ())
                elif state.fresh:
                    _add(merged, own, name, family, ())
        for name, metric in own.items():
            extra = merged.pop(name, None)
            yield metric if extra is None else _joined(metric, extra)
        for name, family in merged.items():
            yield _metric(name, family, family.samples)

    def _carry(self, state: _Slot) -> None:
        for name, family in state.last.items():
            if family.type not in COUNTING or per_worker(name):
                continue
            base = state.carried.setdefault(
                name, _Family(family.type, family.documentation, family.unit)
            )
            for key, value in family.samples.items():
                base.samples[key] = base.samples.get(key, 0.0) + value
        if state.started is not None:
            state.ended_runs = [*state.ended_runs, state.started][-_ENDED_RUNS_KEPT:]
        state.last = {}
        state.started = None
        state.fresh = False


def _kept(parsed: Iterable[Metric]) -> dict[str, _Family]:
    """The families of one worker's scrape the merge uses, with the rows it drops taken out."""
    families = list(parsed)
    counting = {m.name for m in families if m.type in COUNTING}
    kept: dict[str, _Family] = {}
    for metric in families:
        name = metric.name
        if name.endswith("_created") and name.removesuffix("_created") in counting:
            continue  # the text format's separate gauge of a counter's creation times
        if not (summed(name) or per_worker(name)) or name in kept:
            continue
        family = _Family(metric.type, metric.documentation, metric.unit)
        for sample in metric.samples:
            if sample.name == name + "_created" or _dropped_row(name, sample.labels):
                continue
            if metric.type == "summary" and "quantile" in sample.labels:
                continue  # quantiles of separate processes do not add up
            family.samples[(sample.name, tuple(sorted(sample.labels.items())))] = float(
                sample.value
            )
        kept[name] = family
    return kept


def _dropped_row(family: str, labels: dict[str, str]) -> bool:
    return any(family == name and labels.get(label) == value for name, label, value in DROPPED_ROWS)


def _start_time(families: dict[str, _Family]) -> float | None:
    family = families.get(START_TIME)
    if family is None:
        return None
    return next(iter(family.samples.values()), None)


def _went_down(before: dict[str, _Family], after: dict[str, _Family]) -> bool:
    """Some counting sample of ``after`` is lower than in ``before``: the process restarted."""
    for name, family in after.items():
        earlier = before.get(name)
        if earlier is None or family.type not in COUNTING or per_worker(name):
            continue
        for key, value in family.samples.items():
            if value < earlier.samples.get(key, 0.0):
                return True
    return False


def _add(
    merged: dict[str, _Family],
    own: dict[str, Metric],
    name: str,
    family: _Family,
    extra_labels: Labels,
) -> None:
    """Add ``family``'s samples (with ``extra_labels``) into ``merged[name]``, unless control's
    own family of that name has another type (then control's stands alone)."""
    mine = own.get(name)
    if mine is not None and mine.type != family.type:
        return
    into = merged.get(name)
    if into is None:
        into = merged[name] = _Family(family.type, family.documentation, family.unit)
    elif into.type != family.type:
        return  # two workers disagree on a family's type: the first seen wins
    for (sample, labels), value in family.samples.items():
        key = (sample, tuple(sorted(labels + extra_labels)) if extra_labels else labels)
        into.samples[key] = into.samples.get(key, 0.0) + value


def _joined(metric: Metric, extra: _Family) -> Metric:
    """Control's ``metric`` with the workers' samples added to its series, and theirs appended."""
    samples: dict[SampleKey, float] = {}
    for sample in metric.samples:
        key = (sample.name, tuple(sorted(sample.labels.items())))
        samples[key] = samples.get(key, 0.0) + float(sample.value)
    for key, value in extra.samples.items():
        samples[key] = samples.get(key, 0.0) + value
    return _metric(metric.name, extra, samples, metric.documentation, metric.unit)


def _metric(
    name: str,
    family: _Family,
    samples: dict[SampleKey, float],
    documentation: str | None = None,
    unit: str | None = None,
) -> Metric:
    out = Metric(name, documentation or family.documentation, family.type)
    out.unit = family.unit if unit is None else unit
    keys = list(samples)
    if family.type in ("histogram", "gaugehistogram", "summary"):
        keys = _series_order(name, keys)
    for key in keys:
        out.add_sample(key[0], dict(key[1]), samples[key])
    return out


_SUFFIX_RANK = {"_bucket": 0, "_count": 1, "_gcount": 1, "_sum": 2, "_gsum": 2, "_created": 3}


def _series_order(name: str, keys: list[SampleKey]) -> list[SampleKey]:
    """A histogram's samples grouped by series (labels but ``le``/``quantile``) in first-seen
    order, each series' buckets by bound, then its count and sum: as the text format lays them."""
    series: dict[Labels, int] = {}

    def rank(key: SampleKey) -> tuple[int, int, float]:
        sample, labels = key
        others = tuple(kv for kv in labels if kv[0] not in ("le", "quantile"))
        bound = next((v for k, v in labels if k in ("le", "quantile")), "")
        return (
            series.setdefault(others, len(series)),
            _SUFFIX_RANK.get(sample.removeprefix(name), 4),
            _as_float(bound),
        )

    return sorted(keys, key=rank)


def _as_float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return 0.0
