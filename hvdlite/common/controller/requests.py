"""The request table: requests collected by name per process set, validated across ranks
(negotiation.py), grouped calls counted whole (groups.py), cache-bit hits, joins and
shutdowns.
"""
from __future__ import annotations

import logging
import time

from ..messages import (ADD_PROCESS_SET, CACHEABLE_TYPES, ERROR, JOIN, REMOVE_PROCESS_SET,
                       TYPE_NAMES, Request, Response)
from .groups import OpenGroup
from .negotiation import construct_response
from ..protocol import Item
from ..steady import gone_message, set_bits
from .state import THRASH_WARN_RETURNS, SetState

log = logging.getLogger("hvdlite.common.controller")


class RequestTable:
    """Part of controller.core.Coordinator: requests (this module's docstring)."""

    def _sent_before_steady(self, rank: int, set_id: int, tags: dict) -> bool:
        """True for a message sent before its sender saw the set's latest Item.STEADY."""
        s = self.sets.get(set_id)
        return s is not None and s.epoch > 0 and tags.get(set_id, 0) < s.epoch \
            and rank in s.index

    def _set_for(self, rank: int, set_id: int, name: str, out: dict) -> SetState | None:
        s = self.sets.get(set_id)
        if s is None or rank not in s.index:
            self._send_error(rank, set_id, [name],
                             f"rank {rank} submitted tensor '{name}' to process set {set_id}, "
                             f"which {'does not exist' if s is None else 'it is not a member of'}.",
                             out)
            return None
        return s

    def _send_error(self, rank: int, set_id: int, names: list, message: str, out: dict,
                    gone: bool = False) -> None:
        """Fail `names` on `rank`; `gone`: because a member left (the frontends report that as
        a broken job, not as ranks that disagreed: TensorFlow's UnknownError, as Horovod's
        "Horovod has been shut down")."""
        out.setdefault(rank, []).append((Item.RESPONSE, Response(type=ERROR, names=list(names),
                                                       process_set_id=set_id, error=message,
                                                       gone=gone)))

    def _on_request(self, rank: int, req: Request, ready: list, out: dict) -> None:
        s = self._set_for(rank, req.process_set_id, req.name, out)
        if s is None:
            return
        idx = s.index[rank]
        if s.gone:
            gone = sorted(s.ranks[i] for i in s.gone)
            self._send_error(rank, s.id, [req.name], self._gone_message(gone, repr(req.name)), out,
                             gone=True)
            return
        if req.type == JOIN:
            self._on_join(s, idx, rank, ready)
            return
        entry = s.cache.invalidate(req.name)
        if entry is not None:
            # Parameters changed: everyone's pending hit on the old bit becomes a full request.
            self._retire_bits(s, [entry.bit], ready)
        self._add_to_table(s, idx, req, ready)

    def _retire_bits(self, s: SetState, bits: list, ready: list) -> None:
        """Bits left the cache: pending hits on them become full requests again, and every rank
        of the set is told (after this round's responses, which may have introduced them)."""
        for bit in bits:
            s.bit_seen.pop(bit, None)
            entry = s.cache.lookup_bit(bit)
            for j in range(len(s.ranks)):
                if s.pending_bits[j] >> bit & 1:
                    s.pending_bits[j] &= ~(1 << bit)
                    self._add_to_table(s, j, entry.requests[j], ready)
        self._evicted.append((s, list(bits)))

    def _add_to_table(self, s: SetState, idx: int, req: Request, ready: list) -> None:
        reqs = s.table.get(req.name)
        if reqs is None:
            reqs = s.table[req.name] = {}
            s.first_seen[req.name] = time.monotonic()
            if self.timeline is not None:
                self.timeline.negotiate_start(req.name, TYPE_NAMES[req.type])
        reqs[idx] = req
        if self.timeline is not None:
            self.timeline.negotiate_rank(req.name, s.ranks[idx])
        if req.group is not None:
            self._note_group(s, idx, req.group, req.group_size, req.name, req.type, ready)
        self._checks.append((s, req.name, ready))
        if self._checking:
            return
        # Checked from a worklist, not by recursion: a response put in the cache may evict a
        # bit, whose pending hits come back here as requests, whose responses may evict the
        # next bit, and so on. Recursing, a step of more named tensors than the cache holds
        # (~1,100 against the default 1,024) went ~3 frames deeper per eviction until the
        # coordinator died of RecursionError and the job with it.
        self._checking = True
        try:
            while self._checks:
                self._check_ready(*self._checks.popleft())
        finally:
            self._checking = False
            self._checks.clear()

    def _check_ready(self, s: SetState, name: str, ready: list) -> None:
        reqs = s.table.get(name)        # (None: released meanwhile, by a check queued first)
        if reqs is None:
            return
        if s.failed_groups:
            group = next(iter(reqs.values())).group
            if group in s.failed_groups:
                self._fail_member(s, group, name, ready)
                return
        if len(reqs) + len(s.joined - set(reqs)) < len(s.ranks):
            return
        del s.table[name]
        s.first_seen.pop(name, None)
        resp = construct_response(name, reqs, s.ranks, frozenset(s.joined))
        if self.timeline is not None:
            self.timeline.negotiate_end(name)
        groups = {(r.group, r.group_size) for r in reqs.values()}
        if len(groups) > 1:
            self._fail_group(s, name, reqs, resp.error, ready)
            return
        if resp.group is not None:
            self._group_sizes[(s.id, resp.group)] = max(r.group_size for r in reqs.values())
        if resp.type == ADD_PROCESS_SET:
            self._add_process_set(resp)
        elif resp.type == REMOVE_PROCESS_SET:
            self._remove_process_set(resp)
        cacheable = (resp.type in CACHEABLE_TYPES and not s.joined
                     and self.settings.cache_capacity > 0
                     and all(r.cacheable for r in reqs.values()))
        resp.cache_bits = [-1]
        if cacheable:
            bit, evicted = s.cache.put(resp, reqs)
            resp.cache_bits = [bit]
            self._fresh.add((s.id, bit))
            ready.append((s, resp))
            if evicted:
                self._retire_bits(s, evicted, ready)
            if s.cache.returned >= THRASH_WARN_RETURNS and not s.thrash_warned:
                s.thrash_warned = True
                log.warning(
                    "process set %d: the response cache (HOROVOD_CACHE_CAPACITY=%d tensors) is "
                    "smaller than the set of tensors the job keeps submitting: %d tensors it "
                    "evicted to make room were submitted again. Each step then "
                    "negotiates them through the coordinator on rank 0, and the set never "
                    "reaches the steady state. Set HOROVOD_CACHE_CAPACITY (or "
                    "HVDLITE_CACHE_CAPACITY) above the number of named collectives one step "
                    "submits.", s.id, s.cache.capacity, s.cache.returned)
            return
        ready.append((s, resp))

    def _fail_group(self, s: SetState, name: str, reqs: dict, error: str, ready: list) -> None:
        """The ranks put tensor `name` in different groups, or in groups of different sizes
        (construct_response's error): fail it and every member of those groups, now and as the
        rest arrive, on every rank.

        Why: a grouped response is held until its whole group is ready, and a member that only
        some ranks submit (a rank whose group has more tensors) is never ready. The job waited
        until the stall shutdown (600 s by default), whose report then named a healthy rank as
        hung."""
        s.table[name] = reqs                     # (failed below with the others)
        for group in {r.group for r in reqs.values()} - {None}:
            self._group_sizes.pop((s.id, group), None)
            # Each rank's call has its own count of members, every one of them a request
            # (this one's among them): the group is forgotten once all are failed, so that a
            # member arriving late still fails, and the name may be used alike afterwards.
            s.failed_groups.setdefault(group, (error, {
                idx: max(r.group_size, 1) for idx, r in reqs.items() if r.group == group}))
            s.open_groups.pop(group, None)
            for other in [n for n, rs in s.table.items()
                          if any(r.group == group for r in rs.values())]:
                self._fail_member(s, group, other, ready)
        # (`name` is among them: the (group, size) pairs differ, so some rank put it in one.)

    def _note_group(self, s: SetState, idx: int, group: str, size: int, name: str,
                    rtype: int, ready: list) -> None:
        """Set rank `idx` submitted member `name` of its call of `group`, a call of `size`
        members (0: an empty list's stand-in, ops._empty_group): counted in the call's
        OpenGroup, which fails the call on every rank once the ranks' counts or names are
        certain to differ (groups.py says why and when). Members that arrive as cache hits
        are counted too: those pending when a call opens, and those that arrive while it is
        open (_grouped_hits)."""
        if group in s.failed_groups:
            return
        og = s.open_groups.get(group)
        opened = og is None
        if opened:
            og = s.open_groups[group] = OpenGroup()
            for j, bits in enumerate(s.pending_bits):
                for bit in set_bits(bits):
                    entry = s.cache.by_bit.get(bit)
                    if entry is not None and entry.template.group == group:
                        og.add(j, entry.group_size, entry.template.names[0])
        if og.add(idx, size, name) or opened:
            error = og.verdict(s.ranks, s.joined, rtype, group)
            if error is not None:
                self._fail_open_group(s, group, error, ready)

    def _fail_open_group(self, s: SetState, group: str, error: str, ready: list) -> None:
        """Fail the open call of `group` (_note_group) on every rank: its members here (in the
        table, or pending as cache hits) now, and those still to come as they arrive
        (failed_groups). Members every rank submitted and that are ready already (the names
        differ elsewhere) are released as they are; each rank's call fails all the same."""
        og = s.open_groups.pop(group)
        self._group_sizes.pop((s.id, group), None)
        # Requests still to fail per rank (an empty list's stand-in is one request).
        owed = {j: max(n, 1) for j, (n, _) in og.calls.items()}
        s.failed_groups[group] = (error, owed)
        held = s.groups.pop(group, [])
        for resp in held + [r for t, r in ready if t is s and r.group == group]:
            for j in owed:
                owed[j] = max(owed[j] - len(resp.names), 0)
        ready.extend((s, resp) for resp in held)  # (alone: its group's size is forgotten)
        for other in [n for n, rs in s.table.items()
                      if any(r.group == group for r in rs.values())]:
            self._fail_member(s, group, other, ready)
        for j, bits in enumerate(s.pending_bits):
            for bit in set_bits(bits):
                entry = s.cache.by_bit.get(bit)
                if entry is not None and entry.template.group == group \
                        and group in s.failed_groups:
                    s.pending_bits[j] &= ~(1 << bit)
                    if not any(p >> bit & 1 for p in s.pending_bits):
                        s.bit_seen.pop(bit, None)
                    self._add_to_table(s, j, entry.requests[j], ready)
        if group in s.failed_groups and not any(owed.values()):
            del s.failed_groups[group]

    def _fail_member(self, s: SetState, group: str, name: str, ready: list) -> None:
        """Fail `name`, a member of the failed `group` (_fail_group), on every rank; the
        group is forgotten once every rank's members are failed."""
        reqs = s.table.pop(name, None)
        if reqs is None:
            return
        s.first_seen.pop(name, None)
        error, owed = s.failed_groups[group]
        # (No group on the response: it is released at once, not held for its group.)
        ready.append((s, Response(type=ERROR, names=[name], process_set_id=s.id, error=error)))
        for idx, r in reqs.items():
            if r.group == group and owed.get(idx, 0) > 0:
                owed[idx] -= 1
        if not any(owed.values()):
            del s.failed_groups[group]

    def _on_hits(self, rank: int, set_id: int, mask: int, ready: list, out: dict) -> None:
        s = self.sets.get(set_id)
        if s is None or rank not in s.index:
            return
        idx = s.index[rank]
        if s.gone:
            # As for full requests (_on_request): a member already shut down, so these can never
            # be released. Without this, a cache hit sent after the shutdown waited forever.
            names = self._bit_names(s, mask)
            gone = sorted(s.ranks[i] for i in s.gone)
            self._send_error(rank, s.id, names,
                             self._gone_message(gone, ", ".join(repr(n) for n in names[:6])), out,
                             gone=True)
            return
        stale = mask & ~s.cache.valid_mask
        mask &= s.cache.valid_mask
        if s.open_groups or s.failed_groups:
            mask = self._grouped_hits(s, idx, mask, ready)
        now = time.monotonic()
        for bit in set_bits(mask & ~s.pending_bits[idx]):
            s.bit_seen.setdefault(bit, now)
        # The live bits are pending before the stale ones below are handled: a stale bit's
        # request may complete a tensor whose new cache entry evicts one of these bits, and
        # _retire_bits turns only pending bits back into requests. (Added after, an evicted
        # bit stayed pending for a tensor the cache no longer had: with more tensors per step
        # than HOROVOD_CACHE_CAPACITY the job hung within a few steps.)
        s.pending_bits[idx] |= mask
        if stale:
            # The rank used a bit the coordinator has since retired: treat it as a full request,
            # or, once the retired entry is forgotten too, ask the rank to send it in full.
            resend = []
            for bit in set_bits(stale):
                entry = s.cache.lookup_bit(bit)
                if entry is None:
                    resend.append(bit)
                else:
                    self._add_to_table(s, idx, entry.requests[idx], ready)
            if resend:
                out.setdefault(rank, []).append((Item.RESEND, set_id, resend))
        self._release_bits(s, ready)

    def _grouped_hits(self, s: SetState, idx: int, mask: int, ready: list) -> int:
        """`mask` less the hits of set rank `idx` on members of a failed group, which fail
        (as its full requests would, _fail_member); hits on an open group's members are
        counted (_note_group), and fail too where that call fails.

        All of them are counted before any is failed: the verdict may come on the last hit
        of a call (its names compared once all are here), and then every hit of the call
        fails, the ones counted before it too. (Failed as they were counted, only the last
        one was: the others stayed pending for a call the other ranks had already been told
        had failed, and their rank waited for the stall shutdown.)"""
        fresh = [(bit, s.cache.by_bit[bit]) for bit in set_bits(mask & ~s.pending_bits[idx])]
        for bit, entry in fresh:
            group = entry.template.group
            if group is not None and group in s.open_groups:
                self._note_group(s, idx, group, entry.group_size, entry.template.names[0],
                                 entry.template.type, ready)
        for bit, entry in fresh:
            group = entry.template.group
            if group is not None and group in s.failed_groups:
                mask &= ~(1 << bit)
                self._add_to_table(s, idx, entry.requests[idx], ready)
        return mask

    def _release_bits(self, s: SetState, ready: list) -> None:
        common = -1
        active = False
        for j, bits in enumerate(s.pending_bits):
            if j not in s.joined:
                common &= bits
                active = True
        if not active or common <= 0:
            return
        for j in range(len(s.pending_bits)):
            s.pending_bits[j] &= ~common
        joined = tuple(sorted(s.joined))
        for bit in set_bits(common):
            s.bit_seen.pop(bit, None)
            entry = s.cache.by_bit[bit]
            s.cache.touch(entry)
            t = entry.template
            if t.group is not None:
                # A grouped op's hit: _release_ready holds it until its whole group is here.
                self._group_sizes[(s.id, t.group)] = entry.group_size
            resp = Response(type=t.type, names=list(t.names), process_set_id=s.id, dtype=t.dtype,
                            shapes=list(t.shapes), reduce_op=t.reduce_op, prescale=t.prescale,
                            postscale=t.postscale, root_rank=t.root_rank, device=t.device,
                            rank_dims=list(t.rank_dims) if t.rank_dims is not None else None,
                            cache_bits=[bit], joined=joined, group=t.group)
            ready.append((s, resp))

    def _on_join(self, s: SetState, idx: int, rank: int, ready: list) -> None:
        s.joined.add(idx)
        s.last_joined = rank
        for name in list(s.table):
            self._check_ready(s, name, ready)
        if len(s.joined) == len(s.ranks):
            ready.append((s, Response(type=JOIN, names=["join.noname"], process_set_id=s.id,
                                      last_joined_rank=s.last_joined)))
            s.joined.clear()
            s.last_joined = -1
        else:
            self._release_bits(s, ready)

    def _on_shutdown(self, rank: int, out: dict, rounds: dict) -> None:
        """`rounds`: set -> (epoch, steady rounds the rank finished), from its "S" message."""
        self._shut_down_ranks.add(rank)
        for s in self.sets.values():
            if rank not in s.index:
                continue
            s.gone.add(s.index[rank])
            if s.steady:
                # Ranks still steady fail what waits on the gone rank themselves, once the
                # rounds it finished are over there too (engine.Engine._steady_gone).
                epoch, done = rounds.get(s.id, (None, None))
                for other in s.ranks:
                    if other != rank:
                        reason = self._gone_reasons.get(rank)
                        out.setdefault(other, []).append(
                            (Item.GONE, s.id, [rank], epoch, done) + ((reason,) if reason else ()))
            bits = 0
            for b in s.pending_bits:
                bits |= b
            names = list(s.table) + self._bit_names(s, bits)
            if names:
                message = self._gone_message([rank], ", ".join(repr(n) for n in names[:6]))
                for other in s.ranks:
                    if other != rank:
                        self._send_error(other, s.id, names, message, out, gone=True)
                s.table.clear()
                s.first_seen.clear()
                s.pending_bits = [0] * len(s.ranks)
                s.bit_seen.clear()

    @staticmethod
    def _bit_names(s: SetState, bits: int) -> list:
        """The tensor names behind a mask of cache bits (bits the cache forgot are skipped)."""
        names = []
        for bit in set_bits(bits):
            entry = s.cache.lookup_bit(bit)
            if entry is not None:
                names.append(entry.template.names[0])
        return names

    def _gone_message(self, gone: list, what: str) -> str:
        return gone_message(gone, what, self._gone_reasons)
