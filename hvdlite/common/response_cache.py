"""Response cache: a tensor seen before with the same parameters costs one bit, not a request.

The coordinator owns the cache and assigns bits (never reused), announcing each new bit inside the
full response every rank of the set receives, so every rank's cache maps bits to the same tensors.
A rank whose request matches its cached signature sends only the bit; the coordinator releases a
bit when the AND of the ranks' pending bit vectors has it.
"""
from __future__ import annotations

import copy
from collections import OrderedDict
from dataclasses import dataclass

from .messages import Request, Response


@dataclass
class CacheEntry:
    bit: int
    template: Response                 # single-tensor response, cache_bits == [bit]
    requests: dict                     # set rank -> Request, to rebuild a hit as a full request
    group_size: int = 0                # a grouped op's member: how many tensors its group has


class CoordinatorCache:
    """The coordinator's side: LRU of name -> entry, plus recently evicted entries."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.by_name: OrderedDict[str, CacheEntry] = OrderedDict()
        self.by_bit: dict[int, CacheEntry] = {}
        self.graveyard: OrderedDict[int, CacheEntry] = OrderedDict()
        self.valid_mask = 0
        self.next_bit = 0
        self.evictions = 0
        # Names the LRU evicted to make room, and how many of them were cached again since:
        # a cache smaller than a step's tensors evicts names the next step submits again.
        self.evicted_names: OrderedDict[str, None] = OrderedDict()
        self.returned = 0

    def put(self, resp: Response, requests: dict) -> tuple[int, list[int]]:
        """Cache a single-tensor response; returns (bit, evicted bits).

        A grouped op's members are cached one by one, each with its group's name and size, so
        the coordinator can hold a released hit until the rest of its group is there."""
        bit = self.next_bit
        self.next_bit += 1
        template = copy.copy(resp)
        template.names = list(resp.names)
        template.shapes = list(resp.shapes)
        template.rank_dims = list(resp.rank_dims) if resp.rank_dims is not None else None
        template.cache_bits = [bit]
        template.joined = ()
        entry = CacheEntry(bit, template, dict(requests),
                           max((r.group_size for r in requests.values()), default=0))
        if resp.names[0] in self.evicted_names:
            del self.evicted_names[resp.names[0]]
            self.returned += 1
        self.by_name[resp.names[0]] = entry
        self.by_bit[bit] = entry
        self.valid_mask |= 1 << bit
        evicted = []
        while len(self.by_name) > self.capacity:
            name, old = self.by_name.popitem(last=False)
            evicted.append(self._retire(old))
            self.evictions += 1
            self.evicted_names[name] = None
            if len(self.evicted_names) > self.capacity:
                self.evicted_names.popitem(last=False)
        return bit, evicted

    def _retire(self, entry: CacheEntry) -> int:
        self.by_bit.pop(entry.bit, None)
        self.valid_mask &= ~(1 << entry.bit)
        self.graveyard[entry.bit] = entry
        while len(self.graveyard) > max(2 * self.capacity, 64):
            self.graveyard.popitem(last=False)
        return entry.bit

    def invalidate(self, name: str) -> CacheEntry | None:
        """Drop a name whose parameters changed; returns its entry (its bit is retired)."""
        entry = self.by_name.pop(name, None)
        if entry is not None:
            self._retire(entry)
        return entry

    def lookup_bit(self, bit: int) -> CacheEntry | None:
        return self.by_bit.get(bit) or self.graveyard.get(bit)

    def touch(self, entry: CacheEntry) -> None:
        name = entry.template.names[0]
        if name in self.by_name:
            self.by_name.move_to_end(name)


class RankCache:
    """A rank's side: name -> (bit, signature) and bit -> template, per process set."""

    def __init__(self):
        self.by_name: dict[tuple[int, str], tuple[int, tuple]] = {}
        self.templates: dict[tuple[int, int], Response] = {}
        # Fused responses built from templates, by (set, bits, fusion settings): a steady
        # training loop releases the same groups every step, and rebuilding them (expand, fuse,
        # copy) cost ~10 us per release. Any change to the templates forgets them.
        self.built: dict[tuple, list] = {}

    def learn(self, resp: Response, my_requests: dict) -> None:
        """Record the bits a full response announces (my_requests: name -> my Request or None)."""
        if not resp.cache_bits:
            return
        self.built.clear()
        for i, bit in enumerate(resp.cache_bits):
            if bit < 0:
                continue
            name = resp.names[i]
            tmpl = Response(type=resp.type, names=[name], process_set_id=resp.process_set_id,
                            dtype=resp.dtype, shapes=[resp.shapes[i]], reduce_op=resp.reduce_op,
                            prescale=resp.prescale, postscale=resp.postscale,
                            root_rank=resp.root_rank, device=resp.device,
                            rank_dims=[resp.rank_dims[i]] if resp.rank_dims else None,
                            cache_bits=[bit], group=resp.group)
            self.templates[(resp.process_set_id, bit)] = tmpl
            req = my_requests.get(name)
            if req is not None:
                self.by_name[(resp.process_set_id, name)] = (bit, req.signature())

    def hit(self, req: Request) -> int:
        """The bit to send instead of `req`, or -1."""
        found = self.by_name.get((req.process_set_id, req.name))
        if found is not None and found[1] == req.signature():
            return found[0]
        return -1

    def evict(self, set_id: int, bits) -> None:
        self.built.clear()
        for bit in bits:
            tmpl = self.templates.pop((set_id, bit), None)
            if tmpl is not None:
                key = (set_id, tmpl.names[0])
                if self.by_name.get(key, (None,))[0] == bit:
                    del self.by_name[key]

    def expand(self, set_id: int, bits, joined: tuple) -> Response:
        """Rebuild the (fused) response the coordinator sent as a list of bits."""
        first = self.templates[(set_id, bits[0])]
        resp = Response(type=first.type, names=[], process_set_id=set_id, dtype=first.dtype,
                        shapes=[], reduce_op=first.reduce_op, prescale=first.prescale,
                        postscale=first.postscale, root_rank=first.root_rank, device=first.device,
                        rank_dims=[] if first.rank_dims is not None else None,
                        cache_bits=list(bits), joined=joined, group=first.group)
        for bit in bits:
            t = self.templates[(set_id, bit)]
            resp.names.append(t.names[0])
            resp.shapes.append(t.shapes[0])
            if resp.rank_dims is not None:
                resp.rank_dims.append(t.rank_dims[0])
        return resp

    def drop_set(self, set_id: int) -> None:
        self.built.clear()
        self.by_name = {k: v for k, v in self.by_name.items() if k[0] != set_id}
        self.templates = {k: v for k, v in self.templates.items() if k[0] != set_id}
