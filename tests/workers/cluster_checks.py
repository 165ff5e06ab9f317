"""4 ranks on 2 namespaced hosts x 2 slots (tests/cluster.py): what only a real cluster shows.

Usage: hvdlite-run -np 4 -H node1:2,node2:2 python cluster_checks.py [--nic eth1]
  topology      host names, local/cross ranks and sizes against the placement
  private_shm   each host has its own /dev/shm: a rank sees its host's files, never the other's
  shm_local     shared memory carries the collectives of a set within a host, never the global set
                that spans the hosts; results against a local reference
  steady        the steady state: after the first steps, cached allreduces are released between
                the ranks without rank 0's coordinator, over rank-to-rank connections that cross
                the hosts (checked on the process's own TCP connections)
  traffic       (with --nic) 8 allreduces of 8 MiB, results checked; the test reads the
                interfaces' byte counters
"""
from __future__ import annotations

import argparse
import glob
import os
import socket

import psutil
import torch
from ops_common import all_inputs, check, finish, gen, reduce_ref, same

import hvdlite.torch as hvd
from hvdlite.common import basics

p = argparse.ArgumentParser()
p.add_argument("--nic", default=None)
args = p.parse_args()

host_a, host_b = hvd.ProcessSet([0, 1]), hvd.ProcessSet([2, 3])
hvd.init(process_sets=[host_a, host_b])
rank, size = hvd.rank(), hvd.size()
mine = host_a if rank < 2 else host_b
MARK = f"/dev/shm/hvdlite-cluster-check-{os.environ.get('HVDLITE_SECRET', '')[:8]}-{rank}"


def topology():
    assert (size, hvd.local_size(), hvd.cross_size()) == (4, 2, 2), \
        (size, hvd.local_size(), hvd.cross_size())
    assert hvd.local_rank() == rank % 2 and hvd.cross_rank() == rank // 2, \
        (rank, hvd.local_rank(), hvd.cross_rank())
    want = f"node{rank // 2 + 1}"
    assert socket.gethostname() == want, (socket.gethostname(), want)
    assert os.environ["HOROVOD_HOSTNAME"] == want, os.environ["HOROVOD_HOSTNAME"]
    names = hvd.allgather_object(socket.gethostname(), name="hostnames")
    assert names == ["node1", "node1", "node2", "node2"], names


def private_shm():
    with open(MARK, "w") as f:
        f.write(str(rank))
    hvd.barrier()
    seen = []
    for path in glob.glob(MARK[:-len(str(rank))] + "*"):
        with open(path) as f:
            seen.append(int(f.read()))
    seen.sort()
    want = [0, 1] if rank < 2 else [2, 3]
    hvd.barrier()
    os.unlink(MARK)
    assert seen == want, f"rank {rank} sees the /dev/shm files of ranks {seen}, want {want}"


def shm_local():
    before = basics.engine_counters()["shm_collectives"]
    shape = (1 << 16,)
    x = gen(rank, shape, torch.float32, "global")
    same(hvd.allreduce(x, op=hvd.Sum, name="global"),
         reduce_ref(all_inputs(size, shape, torch.float32, "global"), hvd.Sum), "global")
    after_global = basics.engine_counters()["shm_collectives"]
    assert after_global == before, \
        f"the global set spans two hosts but shared memory ran {after_global - before} of it"
    members = mine.ranks
    for k in range(3):
        salt = f"local{k}"
        y = hvd.allreduce(gen(rank, shape, torch.float32, salt), op=hvd.Sum, name=salt,
                          process_set=mine)
        inputs = all_inputs(size, shape, torch.float32, salt)
        same(y, reduce_ref([inputs[r] for r in members], hvd.Sum), salt)
    ran = basics.engine_counters()["shm_collectives"] - after_global
    assert ran >= 3, f"the set {members} on one host ran only {ran} collectives in shared memory"


def steady():
    counters = basics.engine_counters
    x = torch.ones(1024)
    for _ in range(10):
        hvd.allreduce(x, name="steady.grad", op=hvd.Sum)
    start = counters()
    for _ in range(20):
        y = hvd.allreduce(x, name="steady.grad", op=hvd.Sum)
    assert torch.equal(y, x * size)
    end = counters()
    released = end["steady_released"] - start["steady_released"]
    to_coordinator = end["coordinator_messages"] - start["coordinator_messages"]
    assert released >= 20, f"only {released} of 20 cached allreduces released in the steady state"
    assert to_coordinator == 0, f"{to_coordinator} messages to the coordinator in the steady state"
    other = f"node{2 - rank // 2}"
    other_addrs = {info[4][0] for info in socket.getaddrinfo(other, None, socket.AF_INET)}
    if args.nic:
        other_addrs = {a.replace("198.18.", "198.19.") for a in other_addrs}
    peers = {c.raddr.ip for c in psutil.Process().net_connections("tcp")
             if c.raddr and c.status == psutil.CONN_ESTABLISHED}
    assert peers & other_addrs, f"no connection to {other} {sorted(other_addrs)}: {sorted(peers)}"


def traffic():
    shape = (2 << 20,)   # 8 MiB of float32
    for k in range(8):
        salt = f"traffic{k}"
        y = hvd.allreduce(gen(rank, shape, torch.float32, salt), op=hvd.Sum, name=salt)
        same(y, reduce_ref(all_inputs(size, shape, torch.float32, salt), hvd.Sum), salt)


check("topology", topology)
check("private_shm", private_shm)
check("shm_local", shm_local)
check("steady", steady)
if args.nic:
    check("traffic", traffic)
finish()
hvd.shutdown()
