"""Release: ready requests become responses in one global order, fused and sent, and a quiet
set is handed to the ranks (the steady hand-off, Item.STEADY); process sets added and removed.
"""
from __future__ import annotations

import logging

from ..fusion import fuse_responses
from ..messages import (CACHEABLE_TYPES, ERROR, Response)
from ..protocol import Item
from ..response_cache import CoordinatorCache
from ..steady import COMPACT_WIDTH
from .state import SetState

log = logging.getLogger("hvdlite.common.controller")


class Release:
    """Part of controller.core.Coordinator: release (this module's docstring)."""

    # ------------------------------------------------------------------ process sets
    def _add_process_set(self, resp: Response) -> None:
        ranks = list(resp.extra)
        error = None
        if not self.dynamic:
            error = ("add_process_set() needs dynamic process sets: call "
                     "hvd.init(process_sets='dynamic') or set HOROVOD_DYNAMIC_PROCESS_SETS=1.")
        elif not ranks or sorted(set(ranks)) != ranks or ranks[0] < 0 or ranks[-1] >= self.size:
            error = (f"add_process_set({ranks}): ranks must be distinct, sorted and within "
                     f"0..{self.size - 1}.")
        elif any(s.ranks == ranks for s in self.sets.values()):
            error = f"add_process_set({ranks}): a process set with these ranks already exists."
        if error:
            resp.type, resp.error = ERROR, error
            return
        sid = self.next_set_id
        self.next_set_id += 1
        self.sets[sid] = SetState(sid, ranks, CoordinatorCache(self.settings.cache_capacity))
        resp.extra = (sid, tuple(ranks))

    def _remove_process_set(self, resp: Response) -> None:
        sid = resp.extra
        s = self.sets.get(sid)
        error = None
        if not self.dynamic:
            error = ("remove_process_set() needs dynamic process sets: call "
                     "hvd.init(process_sets='dynamic').")
        elif sid == 0:
            error = "the global process set cannot be removed."
        elif s is None:
            error = f"remove_process_set: process set {sid} does not exist."
        elif s.table or any(s.pending_bits):
            error = (f"remove_process_set: process set {sid} still has collectives in flight "
                     f"({sorted(s.table)[:6]}); synchronize them first.")
        if error:
            resp.type, resp.error = ERROR, error
            return
        del self.sets[sid]

    # ------------------------------------------------------------------ release
    def _announce_evictions(self, s: SetState, bits: list, out: dict) -> None:
        for g in s.ranks:
            out.setdefault(g, []).append((Item.EVICT, s.id, list(bits)))

    def _release(self, ready: list, out: dict) -> None:
        self._release_ready(ready, out)
        # Evictions go after the responses: a bit introduced and retired in the same round must
        # reach the ranks as introduced, then retired.
        for s, bits in self._evicted:
            self._announce_evictions(s, bits, out)
        self._evicted = []
        # A grouped member held for the rest of its group keeps its bit fresh until it is
        # released: the ranks learn a bit from the full response only (sent compact, a later
        # round's release named a bit no rank knew).
        self._fresh = {(s.id, b) for s in self.sets.values() if s.groups
                       for held in s.groups.values() for resp in held
                       for b in (resp.cache_bits or ()) if (s.id, b) in self._fresh} \
            if self._fresh else self._fresh
        self._maybe_enter_steady(out)

    def _maybe_enter_steady(self, out: dict) -> None:
        """Hand quiet sets whose tensors come back as cache hits to the ranks (steady.py).

        Not while autotune tunes the coordinator's cycle, nor while a timeline records: the
        timeline's NEGOTIATE phases (who submitted when, who was last) are seen only here."""
        if not self.settings.steady_state or self.autotune is not None:
            return
        if self.timeline is not None and self.timeline.enabled:
            return
        for s in self.sets.values():
            if not s.all_hits:
                continue
            s.all_hits = False
            if (s.steady or s.table or any(s.pending_bits) or s.joined
                    or s.groups or s.failed_groups or s.gone or self.fatal):
                continue
            s.epoch += 1
            s.steady = True
            s.unsteady.clear()
            s.waiting.clear()
            # The rounds' width: every bit the set's tensors can carry until its next fallback
            # (new bits need the coordinator). 0 keeps rounds on the control connections.
            width = s.cache.next_bit if self.settings.steady_rounds == "auto" else 0
            slots = None
            if width > COMPACT_WIDTH:
                # Bits are never reused, so a name whose signature keeps changing (say, an
                # allgather of a varying batch) hands out a new one each time; the rounds then
                # carry only the live ones, numbered 0.. in this order (steady.TransportRound).
                slots = tuple(sorted(s.cache.by_bit))
                width = max(len(slots), 1)
            for g in s.ranks:
                out.setdefault(g, []).append((Item.STEADY, s.id, s.epoch, width, slots))

    def _release_ready(self, ready: list, out: dict) -> None:
        if not ready:
            return
        # Hold grouped responses until the whole group is ready.
        released: list[tuple[SetState, Response]] = []
        for s, resp in ready:
            if resp.group is None:
                released.append((s, resp))
                continue
            members = s.groups.setdefault(resp.group, [])
            members.append(resp)
            size = self._group_size(s, resp)
            if len(members) >= size:
                del s.groups[resp.group]
                self._group_sizes.pop((s.id, resp.group), None)
                s.open_groups.pop(resp.group, None)
                released.extend((s, m) for m in members)
        if not released:
            return
        by_id = {s.id: s for s, _ in released}
        threshold = (self.settings.fusion_threshold if self.autotune is None
                     else self.autotune.fusion_threshold)
        fused = fuse_responses([r for _, r in released], threshold,
                               group_fusion=not self.settings.disable_group_fusion)
        if self.autotune is not None:
            # Autotune hook: score what was released; a new cycle time goes to every rank ahead
            # of these responses (the engine applies Item.CYCLE_TIME items).
            cycle_ms = self.autotune.observe(fused)
            if cycle_ms is not None:
                for g in self.peers:
                    out.setdefault(g, []).append((Item.CYCLE_TIME, cycle_ms))
        hits_only: dict[int, bool] = {}
        for resp in fused:
            s = by_id[resp.process_set_id]
            bits = resp.cache_bits or []
            compact = (resp.type in CACHEABLE_TYPES and bits and all(b >= 0 for b in bits)
                       and not any((s.id, b) in self._fresh for b in bits))
            item = ((Item.CACHED, s.id, tuple(bits), resp.joined) if compact
                    else (Item.RESPONSE, resp))
            hits_only[s.id] = hits_only.get(s.id, True) and compact and not resp.joined
            for g in s.ranks:
                out.setdefault(g, []).append(item)
        for sid, hits in hits_only.items():
            by_id[sid].all_hits = hits

    def _group_size(self, s: SetState, resp: Response) -> int:
        return self._group_sizes.get((s.id, resp.group), 1)
