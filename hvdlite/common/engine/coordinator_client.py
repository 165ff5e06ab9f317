"""The coordinator client: what this rank sends rank 0 (new requests, cache bits, held
buckets), and what it does with the frames rank 0 sends back (protocol.Msg, protocol.Item).
"""
from __future__ import annotations

import logging
import time

from .. import rendezvous
from ..flight_recorder import dump, dump_async
from ..messages import (ALLREDUCE)
from ..protocol import Item, Msg

log = logging.getLogger("hvdlite.common.engine")


class CoordinatorClient:
    """Part of engine.core.Engine: the coordinator client (this module's docstring)."""

    def _send_queued(self) -> None:
        with self._lock:
            entries = list(self._queue)
            self._queue.clear()
        if entries and self.steady and self.buckets.enabled:
            with self._lock:
                entries = self._hold_back(entries)
        self._dispatch(entries)

    def _hold_back(self, entries: list) -> list:
        """Hold steady-state allreduces until their bucket is complete (buckets.py); returns
        what goes now, in submission order, including held entries whose bucket just filled.
        Called with self._lock held, from enqueue (the caller's thread) or the background
        thread; each entry is planned once."""
        now = time.monotonic()
        go = []
        for e in entries:
            req = e.request
            sid = req.process_set_id
            st = self.steady.get(sid)
            # A one-member set sends nothing: holding its tensors for a bucket gains nothing.
            if e.planned or st is None or len(st.ranks) == 1 or req.type != ALLREDUCE \
                    or req.group is not None or not req.cacheable:
                e.planned = True
                go.append(e)
                continue
            e.planned = True
            marks, boundary = self._wait_marks, False
            while marks and marks[0] < e.seq:     # a caller waited before e was submitted...
                boundary = boundary or marks[0] >= self._observed_seq   # ...and after the last
                marks.popleft()
            self._observed_seq = e.seq
            new_pass, bucket = self.buckets.observe(sid, req.name, req.nbytes(), now, boundary,
                                                    req.device >= 0)
            if new_pass:                  # a new step began: whatever the last one held goes
                go[:0] = [h[0] for h in self._held if h[1] == sid]
                self._held = [h for h in self._held if h[1] != sid]
            if bucket < 0 or self._flush:
                done = {h[2] for h in self._held if h[1] == sid
                        and self.buckets.complete(sid, h[2])}
                if done:
                    go.extend(h[0] for h in self._held if h[1] == sid and h[2] in done)
                    self._held = [h for h in self._held if not (h[1] == sid and h[2] in done)]
                go.append(e)
            else:
                self._held.append((e, sid, bucket, now + self.buckets.hold_s(sid)))
        if self._flush:
            self._flush = False
            go.extend(h[0] for h in self._held)
            self._held = []
        return go

    def _release_held(self) -> None:
        """Send held entries that are due: on a waiter's request, past their deadline, or whose
        set is no longer steady (they go to the coordinator like any other request)."""
        now = time.monotonic()
        with self._lock:
            flush, self._flush = self._flush, False
            go = [h for h in self._held if flush or now >= h[3] or h[1] not in self.steady]
            if go:
                self._held = [h for h in self._held
                              if not (flush or now >= h[3] or h[1] not in self.steady)]
        if go:
            self._dispatch([h[0] for h in go])

    def _dispatch(self, entries: list) -> None:
        """Hand entries on: cached ones of a steady set to its rounds, the rest to rank 0."""
        if not entries:
            return
        if self.steady:
            rest = []
            by_set: dict[int, list] = {}
            for e in entries:
                sid = e.request.process_set_id
                if sid in self.steady:
                    by_set.setdefault(sid, []).append(e)
                else:
                    rest.append(e)
            for sid, mine in by_set.items():
                st = self.steady[sid]
                self._steady_add(st, mine)
                self._steady_kick(st)
            entries = rest
        if entries:
            self._send_entries(entries, self.epochs)

    def _send_entries(self, entries: list, tags: dict) -> None:
        """Send requests, or just their cache bits (any thread; the channel serializes).

        `tags` says, per set, the last steady-state epoch this rank has seen, so the coordinator
        can hand back what was sent before the rank saw its latest Item.STEADY (steady.py)."""
        full = []
        masks: dict[int, int] = {}
        for e in entries:
            req = e.request
            bit = self.cache.hit(req) if req.cacheable else -1
            e.sent_bit = bit
            if bit >= 0:
                masks[req.process_set_id] = masks.get(req.process_set_id, 0) | (1 << bit)
            else:
                full.append(req)
        self._last_send = time.monotonic()
        if self.timeline is not None and self.timeline.enabled:
            self.timeline.cycle()
        sets = {e.request.process_set_id for e in entries}
        self.counters["coordinator_messages"] += 1
        self.counters["coordinator_tensors"] += len(entries)
        try:
            self.channel.send((Msg.QUERY, full, list(masks.items()),
                               {sid: tags.get(sid, 0) for sid in sets}))
        except OSError as exc:
            self._close(f"rank {self.rank} could not reach the coordinator: {exc}")

    def _resend(self, set_id: int, bits: list) -> None:
        """The coordinator forgot these bits before our hits arrived: send the requests in full."""
        wanted = set(bits)
        with self._lock:
            reqs = [e.request for e in self._inflight.values()
                    if e.request.process_set_id == set_id and e.sent_bit in wanted]
        for e_bit in wanted:
            self.cache.evict(set_id, [e_bit])
        self.counters["coordinator_messages"] += 1
        try:
            self.channel.send((Msg.QUERY, reqs, [], {set_id: self.epochs.get(set_id, 0)}))
        except OSError as exc:
            self._close(f"rank {self.rank} could not reach the coordinator: {exc}")

    def _maybe_send(self) -> None:
        if self._queue and time.monotonic() - self._last_send >= self.cycle_s:
            self._send_queued()

    def _on_message(self, msg) -> bool:
        kind = msg[0]
        if kind == Msg.RESPONSES:
            for item in msg[1]:
                tag = item[0]
                if tag == Item.RESPONSE:
                    self._execute(item[1])
                elif tag == Item.CACHED:
                    _, set_id, bits, joined = item
                    self._execute(self.cache.expand(set_id, bits, joined), cached=True)
                elif tag == Item.EVICT:
                    st = self.steady.get(item[1])
                    if st is not None:
                        st.deferred.append(item[2])   # applied once this rank falls back
                    else:
                        self.cache.evict(item[1], item[2])
                elif tag == Item.STEADY:
                    self._enter_steady(item[1], item[2], item[3] if len(item) > 3 else 0,
                                       item[4] if len(item) > 4 else None)
                elif tag == Item.TAKE_BACK:
                    self._take_back(item[1], item[2], item[3])
                elif tag == Item.GONE:
                    if len(item) > 5 and item[5]:
                        self._gone_reasons.update({r: item[5] for r in item[2]})
                    self._steady_gone(item[1], item[2], *item[3:5])
                elif tag == Item.RESEND:
                    self._resend(item[1], item[2])
                elif tag == Item.CYCLE_TIME:
                    # Autotune hook: the coordinator's tuner set a new cycle time (ms).
                    self.cycle_s = max(float(item[1]), 0.0) / 1000.0
                if self._closed is not None:
                    return False
            return True
        if kind == Msg.FATAL:
            if len(msg) > 2 and isinstance(msg[2], dict):
                if msg[2].get("dump"):
                    dump(msg[2]["dump"])  # now, before closing changes the records' states
                if msg[2].get("hung"):
                    # Elastic: the next join request names them, so the driver ends them.
                    rendezvous.report_hung(msg[2]["hung"])
            self._close(msg[1])
            return False
        if kind == Msg.DUMP:
            dump_async(msg[1])  # the coordinator saw a stall: flight-recorder dump
        elif kind == Msg.HEARTBEAT and self.pace is not None:
            total, count = self.pace.take()
            if count:
                self._send_coordinator((Msg.PACE, total, count))
        return True

    # ------------------------------------------------------------------ steady state
    def _send_coordinator(self, msg) -> None:
        self.counters["coordinator_messages"] += 1
        try:
            self.channel.send(msg)
        except OSError as exc:
            self._close(f"rank {self.rank} could not reach the coordinator: {exc}")

    # ------------------------------------------------------------------ peer connections
