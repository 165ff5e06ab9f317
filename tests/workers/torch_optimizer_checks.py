"""hvd.DistributedOptimizer, every option, against a single-process reference (2 ranks).

Every rank builds the whole global batch from a seeded generator and trains on its own slice;
the reference model (same seed) trains in this process on the whole batch with the equivalent
plain optimizer. After a few steps each rank's weights must equal the reference, and be
identical on every rank. Prints one `CHECK <name> OK|FAIL` line per check and `FINISHED`
(tests/workers/harness.py).

Run three times (tests/test_torch_optimizer.py): `--path flat` gives each rank one core, so the
engine sends a step's gradients as one bucket, and moves data over TCP (HVDLITE_SHM=0), so after
the first step the gradients live in one flat buffer reduced by one allreduce
(torch/flat_grads.py); `--path deferred` is the same through shared memory, which fuses with no
fusion buffer, so the optimizer submits each gradient's own allreduce together when
backpropagation ends; `--path per-hook` sets the bucket size explicitly
(HVDLITE_BUCKET_CAP_MB), so every gradient is submitted from its own hook, as in Horovod. The
checks are the same.
"""
from __future__ import annotations

import os
import sys
import warnings

PATH = sys.argv[sys.argv.index("--path") + 1]
if PATH in ("flat", "deferred"):
    # One core per rank (before init: the engine decides its buckets from this).
    cores = sorted(os.sched_getaffinity(0))
    rank = os.environ.get("HOROVOD_RANK") or os.environ.get("PMI_RANK", "0")   # (mpiexec)
    os.sched_setaffinity(0, {cores[int(rank) % len(cores)]})

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import hvdlite.torch as hvd  # noqa: E402
import harness  # noqa: E402
import hvdlite.torch.optimizer as hopt  # noqa: E402
import hvdlite.torch.flat_grads as hflat  # noqa: E402
from hvdlite.common import ops as hops  # noqa: E402

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
torch.set_num_threads(1)
N_LOCAL = 4
STEPS = 4
FLAT = PATH == "flat"
DEFERRED = PATH in ("flat", "deferred")
hvd.allreduce(torch.zeros(1), name="first_collective")   # (makes the set's communicator)
assert hops.fuses_in_place() == (PATH != "flat"), (PATH, hops.fuses_in_place())
assert hops.whole_pass() == DEFERRED, (PATH, hops.whole_pass())

# Record what the optimizer hands to the collectives (names, op, scale factors, process set).
CALLS: list[dict] = []
_orig_allreduce_async_ = hopt.allreduce_async_
_orig_grouped_allreduce_async_ = hopt.grouped_allreduce_async_
_orig_sparse_allreduce_async = hopt.sparse_allreduce_async


_orig_allreduce_batch_async = hopt._allreduce_batch_async


def _rec_allreduce_async_(tensor, **kw):
    CALLS.append(dict(kind="allreduce", deferred=False, **kw))
    return _orig_allreduce_async_(tensor, **kw)


BATCHES: list[int] = []     # tensors per deferred submission


def _rec_allreduce_batch_async(tensors, names, op, prescale_factor, postscale_factor,
                               process_set):
    # Each tensor of a deferred batch is its own allreduce: one record each.
    BATCHES.append(len(tensors))
    CALLS.extend(dict(kind="allreduce", deferred=True, name=n, op=op,
                      prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                      process_set=process_set) for n in names)
    return _orig_allreduce_batch_async(tensors, names, op, prescale_factor, postscale_factor,
                                       process_set)


def _rec_grouped_allreduce_async_(tensors, **kw):
    CALLS.append(dict(kind="grouped", n=len(tensors), **kw))
    return _orig_grouped_allreduce_async_(tensors, **kw)


def _rec_sparse_allreduce_async(tensor, **kw):
    CALLS.append(dict(kind="sparse", **kw))
    return _orig_sparse_allreduce_async(tensor, **kw)


_orig_reduce_flat = hflat.reduce_flat


def _rec_reduce_flat(buffer, name, op, prescale, postscale, process_set):
    CALLS.append(dict(kind="flat", name=name, op=op, prescale_factor=prescale,
                      postscale_factor=postscale, process_set=process_set, numel=buffer.numel()))
    return _orig_reduce_flat(buffer, name, op, prescale, postscale, process_set)


def per_param(calls):
    """The records of per-parameter allreduces (not the flat buffers')."""
    return [c for c in calls if c["kind"] != "flat"]


def flat_calls(calls):
    return [c for c in calls if c["kind"] == "flat"]


def assert_flat(opt, model, steps_flat):
    """On the flat path: every parameter's gradient is a view of the flat buffer, reduced by
    one call per step after the first; elsewhere no flat call at all."""
    flats = flat_calls(CALLS)
    if not FLAT:
        assert not flats and not (opt._flat and opt._flat.active), flats
        return
    assert opt._flat.active
    assert len(flats) == steps_flat, flats
    assert all(c["name"].startswith("allreduce.hvdlite.flat.float32.") for c in flats), flats
    (name, buffer), = opt._flat.buffers
    assert buffer.numel() == sum(p.numel() for p in model.parameters())
    for p in model.parameters():
        assert p.grad.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()


hopt.allreduce_async_ = _rec_allreduce_async_
hflat.reduce_flat = _rec_reduce_flat
hopt._allreduce_batch_async = _rec_allreduce_batch_async
hopt.grouped_allreduce_async_ = _rec_grouped_allreduce_async_
hopt.sparse_allreduce_async = _rec_sparse_allreduce_async


def make_model(seed=1):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def global_batch(step, salt=0, n_local=N_LOCAL):
    g = torch.Generator().manual_seed(1000 * salt + step)
    x = torch.randn(SIZE * n_local, 6, generator=g)
    y = torch.randn(SIZE * n_local, 3, generator=g)
    return x, y


def local(t, n_local=N_LOCAL):
    return t[RANK * n_local:(RANK + 1) * n_local]


def assert_same_as(model, ref, **tol):
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), msg=lambda m: f"{name}: {m}", **tol)


def assert_identical_across_ranks(model):
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = hvd.allgather(flat.unsqueeze(0), name="identical_check")
    for r in range(SIZE):
        assert torch.equal(gathered[r], flat), f"weights differ between rank {RANK} and {r}"


def step_both(model, opt, ref, ref_opt, x, y, loss_fn=F.mse_loss, ref_scale=1.0):
    """One step of the distributed model on this rank's slice and of the reference on the
    whole batch."""
    opt.zero_grad()
    loss_fn(model(local(x)), local(y)).backward()
    opt.step()
    ref_opt.zero_grad()
    (ref_scale * loss_fn(ref(x), y)).backward()
    ref_opt.step()


def train_pair(make_opt, make_ref_opt, steps=STEPS, salt=0, ref_scale=1.0, dist_kwargs=None,
               model_fn=make_model, loss_fn=F.mse_loss):
    """Train the distributed model and the reference side by side; return both."""
    model, ref = model_fn(), model_fn()
    opt = hvd.DistributedOptimizer(make_opt(model), **(dist_kwargs or {}))
    ref_opt = make_ref_opt(ref)
    for step in range(steps):
        x, y = global_batch(step, salt)
        step_both(model, opt, ref, ref_opt, x, y, loss_fn, ref_scale)
    return model, ref, opt


def sgd(m, lr=0.1, momentum=0.9):
    return torch.optim.SGD(m.parameters(), lr=lr, momentum=momentum)


CHECKS = []


def check(fn):
    CHECKS.append(fn)
    return fn


@check
def named_parameters_average():
    CALLS.clear()
    BATCHES.clear()
    model, ref = make_model(), make_model()
    base = sgd(model)
    opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
    assert type(opt).__name__ == "SGD" and isinstance(opt, torch.optim.SGD)
    assert type(opt) is not torch.optim.SGD
    assert opt.param_groups[0]["lr"] == 0.1 and opt.param_groups[0]["momentum"] == 0.9
    ref_opt = sgd(ref)
    for step in range(STEPS):
        x, y = global_batch(step)
        step_both(model, opt, ref, ref_opt, x, y)
    assert_same_as(model, ref)
    assert_identical_across_ranks(model)
    names = {c["name"] for c in per_param(CALLS)}
    assert names == {f"allreduce.{n}" for n, _ in model.named_parameters()}, names
    assert all(c["kind"] in ("allreduce", "flat") and c["op"] == hvd.Average
               and c["prescale_factor"] == 1.0 and c["postscale_factor"] == 1.0
               and c["process_set"] is hvd.global_process_set for c in CALLS), CALLS
    # Flat: the first step per parameter (the ranks agree at its end), then one flat call.
    steps_per_param = 1 if FLAT else STEPS
    assert len(per_param(CALLS)) == steps_per_param * 4, len(CALLS)
    assert all(c["deferred"] == DEFERRED for c in per_param(CALLS)), (PATH, CALLS)
    # Deferred: one submission per backward pass, when it ends, with all four gradients.
    assert BATCHES == ([4] * steps_per_param if DEFERRED else []), BATCHES
    assert_flat(opt, model, STEPS - steps_per_param)


@check
def default_names_and_param_groups():
    CALLS.clear()

    def groups(m, cls=torch.optim.SGD):
        return cls([{"params": m[0].parameters()},
                    {"params": m[2].parameters(), "lr": 0.05}], lr=0.1, momentum=0.5)

    model, ref, opt = train_pair(groups, groups)
    assert_same_as(model, ref)
    assert_identical_across_ranks(model)
    names = {c["name"] for c in per_param(CALLS)}
    assert names == {"allreduce.noname.0.0", "allreduce.noname.0.1", "allreduce.noname.1.0",
                     "allreduce.noname.1.1"}, names
    assert_flat(opt, model, STEPS - 1)
    # The user's defaults survive the wrapping (add_param_group uses them).
    assert opt.defaults["lr"] == 0.1 and opt.defaults["momentum"] == 0.5


@check
def adam():
    model, ref, _ = train_pair(lambda m: torch.optim.Adam(m.parameters(), lr=0.01),
                               lambda m: torch.optim.Adam(m.parameters(), lr=0.01))
    assert_same_as(model, ref)
    assert_identical_across_ranks(model)


@check
def compression_fp16():
    CALLS.clear()
    model, ref, _ = train_pair(sgd, sgd, dist_kwargs=dict(
        compression=hvd.Compression.fp16))
    assert_same_as(model, ref, rtol=2e-3, atol=2e-3)
    assert_identical_across_ranks(model)
    # (Compressed gradients never take the flat path.)
    assert CALLS and all(c["kind"] == "allreduce" for c in CALLS)
    for p in model.parameters():
        assert p.grad.dtype == torch.float32


@check
def op_sum():
    CALLS.clear()
    # Sum of every rank's mean loss gradient == SIZE x the global-batch mean loss gradient.
    model, ref, _ = train_pair(lambda m: sgd(m, lr=0.05), lambda m: sgd(m, lr=0.05),
                               ref_scale=float(SIZE), dist_kwargs=dict(op=hvd.Sum))
    assert_same_as(model, ref)
    assert_identical_across_ranks(model)
    assert all(c["op"] == hvd.Sum and c["prescale_factor"] == 1.0
               and c["postscale_factor"] == 1.0 for c in CALLS)


@check
def gradient_predivide_factor():
    CALLS.clear()
    model, ref, _ = train_pair(sgd, sgd, dist_kwargs=dict(gradient_predivide_factor=4.0))
    assert_same_as(model, ref)
    assert_identical_across_ranks(model)
    assert CALLS and all(c["op"] == hvd.Average and c["prescale_factor"] == 0.25
                         and c["postscale_factor"] == 4.0 for c in CALLS), CALLS[:2]
    for op in (hvd.Sum, hvd.Min):
        try:
            hvd.DistributedOptimizer(sgd(make_model()), op=op, gradient_predivide_factor=2.0)
        except ValueError as exc:
            assert str(exc) == "gradient_predivide_factor not supported with op != Average"
        else:
            raise AssertionError("gradient_predivide_factor with op=Sum did not raise")


@check
def backward_passes_per_step_2():
    for use_setter in (False, True):
        model, ref = make_model(), make_model()
        if use_setter:
            opt = hvd.DistributedOptimizer(sgd(model), named_parameters=model.named_parameters())
            opt.set_backward_passes_per_step(2)
        else:
            opt = hvd.DistributedOptimizer(sgd(model), named_parameters=model.named_parameters(),
                                           backward_passes_per_step=2)
        assert opt.backward_passes_per_step == 2
        ref_opt = sgd(ref)
        for step in range(3):
            opt.zero_grad()
            ref_opt.zero_grad()
            for micro in range(2):
                x, y = global_batch(10 * step + micro, salt=3)
                F.mse_loss(model(local(x)), local(y)).backward()
                if micro == 0:
                    # Accumulating locally: nothing submitted yet.
                    assert all(h is None for h, _ in opt._handles.values()), opt._handles
                F.mse_loss(ref(x), y).backward()
            opt.step()
            ref_opt.step()
        assert_same_as(model, ref)
        assert_identical_across_ranks(model)


@check
def elastic_reset_drops_a_partial_step():
    """An elastic reset one pass into a step of backward_passes_per_step=2: TorchState's reset
    (what every rank runs after a membership change) makes the optimizer forget that pass, so
    the ranks count the next step's passes alike and the step equals the reference's."""
    model, ref = make_model(), make_model()
    opt = hvd.DistributedOptimizer(sgd(model), named_parameters=model.named_parameters(),
                                   backward_passes_per_step=2)
    ref_opt = sgd(ref)
    state = hvd.elastic.TorchState(model=model, optimizer=opt)
    x, y = global_batch(70, salt=6)
    (100.0 * F.mse_loss(model(local(x)), local(y))).backward()     # pass 1 of 2, then a reset
    state.on_reset()
    assert all(p.grad is None for p in model.parameters())
    assert all(d == 2 for d in opt._allreduce_delay.values()), opt._allreduce_delay
    for step in range(2):
        for micro in range(2):
            x, y = global_batch(71 + 2 * step + micro, salt=6)
            F.mse_loss(model(local(x)), local(y)).backward()
            F.mse_loss(ref(x), y).backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    assert_same_as(model, ref)
    assert_identical_across_ranks(model)


@check
def elastic_states_with_horovod_signatures():
    """A state written for Horovod: ObjectState with a one-argument bcast_object, and a
    StateHandler subclass whose sync() takes no root. Both sync, including where the reset
    agreement picks rank 1 as the root (it committed once more): the one-argument broadcast
    still runs and every rank gets rank 1's values; hvdlite's two-argument form still works."""
    calls = []

    def bcast_one(obj):                                   # Horovod's signature: from rank 0
        calls.append(1)
        return hvd.broadcast_object(obj, root_rank=0, name="test.elastic.one_arg")

    state = hvd.elastic.ObjectState(bcast_one, hvd.rank, epoch=10 * hvd.rank(), tags=["a"])
    state.commit()
    if hvd.rank() == 1:
        state.commit()                          # rank 1 holds the latest commit: the root
    state.epoch, state.tags = 100 + hvd.rank(), [hvd.rank()]
    state.save()
    assert state._agree_and_sync(False) and state.sync_root == 1
    assert (state.epoch, state.tags) == (101, [1]) and calls == [1], (state.epoch, calls)
    two = hvd.elastic.ObjectState(bcast_object=lambda obj, root: hvd.broadcast_object(
        obj, root_rank=root, name="test.elastic.two_args"), step=hvd.rank())
    two._sync_root = 1
    two.sync()
    assert two.step == 1, two.step

    class CounterHandler(hvd.elastic.StateHandler):      # as in Horovod's own docs
        def save(self):
            self.saved = self.value.n

        def restore(self):
            self.value.n = self.saved

        def sync(self):                                   # in place, as Horovod's handlers
            self.value.n = hvd.broadcast_object(self.value.n, root_rank=0, name="test.counter")

    class Counter:
        def __init__(self, n):
            self.n = n

    registry = hvd.elastic.get_handler_registry()
    hvd.elastic.set_handler_registry(registry + [(Counter, CounterHandler)])
    try:
        torch_state = hvd.elastic.TorchState(counter=Counter(5 + hvd.rank()), model=make_model())
        torch_state.sync()
        assert torch_state.counter.n == 5, torch_state.counter.n
    finally:
        hvd.elastic.set_handler_registry(registry)


@check
def too_many_backward_passes():
    model = make_model()
    opt = hvd.DistributedOptimizer(sgd(model), named_parameters=model.named_parameters())
    x, y = global_batch(0)
    F.mse_loss(model(local(x)), local(y)).backward()
    try:
        F.mse_loss(model(local(x)), local(y)).backward()
    except AssertionError as exc:
        assert "Gradients were computed more than backward_passes_per_step times before call " \
               "to step(). Increase backward_passes_per_step to accumulate gradients " \
               "locally." in str(exc), str(exc)
    else:
        raise AssertionError("a second backward pass before step() did not raise")
    opt.synchronize()
    opt.zero_grad()
    for bad in (0, -1):
        try:
            hvd.DistributedOptimizer(sgd(make_model()), backward_passes_per_step=bad)
        except ValueError as exc:
            assert str(exc) == "backward_passes_per_step must be > 0"
        else:
            raise AssertionError("backward_passes_per_step <= 0 did not raise")


class _FailsBackward(torch.autograd.Function):
    """Identity whose backward raises: backpropagation stops half-way through the model."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("backward fails here on purpose")


@check
def backward_raises_midway():
    # The second layer's gradients are ready (and, deferred, not yet submitted) when
    # backpropagation raises; synchronize() must still reduce them, and the first layer's
    # (never computed) count as zeros, as for an unused parameter.
    model = make_model()
    opt = hvd.DistributedOptimizer(sgd(model), named_parameters=model.named_parameters())
    x, y = global_batch(0, salt=11)
    first, _, second = model
    # The reference: the second layer's gradient on the whole batch, in this process (equal
    # slices: the average of the ranks' gradients). Not a clone of this rank's gradient after
    # the failed pass: per hook, its allreduce is already in flight, in place, and may have
    # half-written it.
    ref = make_model()
    F.mse_loss(ref[2](torch.tanh(ref[0](x)).detach()), y).backward()
    expected = [ref[2].weight.grad, ref[2].bias.grad]
    out = second(_FailsBackward.apply(torch.tanh(first(local(x)))))
    try:
        F.mse_loss(out, local(y)).backward()
    except RuntimeError as exc:
        assert "on purpose" in str(exc), str(exc)
    else:
        raise AssertionError("backward did not raise")
    assert first.weight.grad is None
    # Deferred: the pass never reached its end, so its two gradients wait, unsubmitted.
    assert len(opt._deferred) == (2 if DEFERRED else 0), opt._deferred
    opt.synchronize()
    torch.testing.assert_close(second.weight.grad, expected[0])
    torch.testing.assert_close(second.bias.grad, expected[1])
    assert torch.equal(first.weight.grad, torch.zeros_like(first.weight))
    with opt.skip_synchronize():
        opt.step()
    opt.zero_grad()                   # nothing outstanding any more
    assert_identical_across_ranks(model)


@check
def groups_int_and_num_groups():
    for kwargs in (dict(groups=2), dict(num_groups=2)):
        CALLS.clear()
        model, ref = make_model(), make_model()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt = hvd.DistributedOptimizer(sgd(model), named_parameters=model.named_parameters(),
                                           **kwargs)
        if "num_groups" in kwargs:
            assert any(issubclass(w.category, DeprecationWarning) and "num_groups" in
                       str(w.message) for w in caught), [str(w.message) for w in caught]
        ref_opt = sgd(ref)
        for step in range(STEPS):
            x, y = global_batch(step, salt=4)
            opt.zero_grad()
            F.mse_loss(model(local(x)), local(y)).backward()
            keys = list(opt._handles)
            assert len(keys) == 2 and all(isinstance(k, tuple) and len(k) == 2 for k in keys), \
                keys
            opt.step()
            ref_opt.zero_grad()
            F.mse_loss(ref(x), y).backward()
            ref_opt.step()
        assert_same_as(model, ref)
        assert_identical_across_ranks(model)
        assert CALLS and all(c["kind"] == "grouped" and c["n"] == 2 for c in CALLS), CALLS[:3]
        # Parameters are split in rank 0's parameter order: 0.weight,0.bias | 2.weight,2.bias;
        # a group is named after its first parameter.
        firsts = {c["name"] for c in CALLS}
        assert firsts == {"allreduce.0.weight", "allreduce.2.weight"}, firsts


@check
def groups_list():
    CALLS.clear()
    model, ref = make_model(), make_model()
    group = [model[0].weight, model[2].weight]
    opt = hvd.DistributedOptimizer(sgd(model), named_parameters=model.named_parameters(),
                                   groups=[group])
    ref_opt = sgd(ref)
    for step in range(STEPS):
        x, y = global_batch(step, salt=5)
        opt.zero_grad()
        F.mse_loss(model(local(x)), local(y)).backward()
        sizes = sorted(len(k) for k in opt._handles)
        assert sizes == [1, 1, 2], sizes
        opt.step()
        ref_opt.zero_grad()
        F.mse_loss(ref(x), y).backward()
        ref_opt.step()
    assert_same_as(model, ref)
    assert_identical_across_ranks(model)
    assert sorted(c["n"] for c in CALLS[:3]) == [1, 1, 2]
    for bad, msg in ((-1, "groups should be a non-negative integer or a list of list of "
                          "torch.Tensor."),
                     ([[1.0]], "groups must consist of torch.Tensor."),
                     ([[model[0].weight], [model[0].weight]],
                      "A parameter can only appear once in groups.")):
        try:
            hvd.DistributedOptimizer(sgd(make_model()), groups=bad)
        except ValueError as exc:
            assert str(exc) == msg, str(exc)
        else:
            raise AssertionError(f"groups={bad!r} did not raise")


class EmbedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 4, sparse=True)
        self.fc = nn.Linear(4, 3)

    def forward(self, idx):
        return self.fc(self.emb(idx).mean(1))


def make_embed():
    torch.manual_seed(7)
    return EmbedNet()


@check
def sparse_gradients():
    for sparse_as_dense in (False, True):
        CALLS.clear()
        model, ref = make_embed(), make_embed()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.2),
                                       named_parameters=model.named_parameters(),
                                       sparse_as_dense=sparse_as_dense)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.2)
        for step in range(STEPS):
            g = torch.Generator().manual_seed(500 + step)
            # Each rank looks up different rows (some rows only on one rank, some on both).
            idx = torch.randint(0, 20, (SIZE * N_LOCAL, 3), generator=g)
            y = torch.randn(SIZE * N_LOCAL, 3, generator=g)
            opt.zero_grad()
            F.mse_loss(model(local(idx)), local(y)).backward()
            assert model.emb.weight.grad.is_sparse
            opt.step()
            assert model.emb.weight.grad.is_sparse
            ref_opt.zero_grad()
            F.mse_loss(ref(idx), y).backward()
            ref_opt.step()
        assert_same_as(model, ref)
        assert_identical_across_ranks(model)
        kinds = {c["name"]: c["kind"] for c in CALLS}
        expected = "allreduce" if sparse_as_dense else "sparse"
        assert kinds["allreduce.emb.weight"] == expected, kinds
        assert kinds["allreduce.fc.weight"] == "allreduce", kinds


@check
def synchronize_clip_skip_synchronize():
    model, ref = make_model(), make_model()
    opt = hvd.DistributedOptimizer(sgd(model), named_parameters=model.named_parameters())
    ref_opt = sgd(ref)
    for step in range(STEPS):
        x, y = global_batch(step, salt=6)
        opt.zero_grad()
        F.mse_loss(model(local(x)), local(y)).backward()
        opt.synchronize()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with opt.skip_synchronize():
                opt.step()
        ref_opt.zero_grad()
        F.mse_loss(ref(x), y).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        torch.testing.assert_close(norm, ref_norm)
        assert ref_norm > 0.05  # clipping really happened
        ref_opt.step()
    assert_same_as(model, ref)
    assert_identical_across_ranks(model)

    # step() after synchronize() without skip_synchronize(): Horovod's warning.
    x, y = global_batch(99, salt=6)
    opt.zero_grad()
    F.mse_loss(model(local(x)), local(y)).backward()
    opt.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    assert any("optimizer.step() called without optimizer.skip_synchronize() context after "
               "optimizer.synchronize()" in str(w.message) for w in caught), \
        [str(w.message) for w in caught]
    assert_identical_across_ranks(model)


@check
def zero_grad_guard():
    model = make_model()
    opt = hvd.DistributedOptimizer(sgd(model), named_parameters=model.named_parameters())
    x, y = global_batch(0)
    F.mse_loss(model(local(x)), local(y)).backward()
    try:
        opt.zero_grad()
    except AssertionError as exc:
        assert str(exc) == ("optimizer.zero_grad() was called after loss.backward() but before "
                            "optimizer.step() or optimizer.synchronize(). This is prohibited as "
                            "it can cause a race condition."), str(exc)
    else:
        raise AssertionError("zero_grad() with outstanding allreduces did not raise")
    opt.synchronize()
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    opt.zero_grad(set_to_none=False)


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(6, 8)
        self.a = nn.Linear(8, 3)
        self.b = nn.Linear(8, 3)
        self.never = nn.Linear(8, 3)

    def forward(self, x, use_b):
        h = torch.tanh(self.body(x))
        out = self.a(h)
        return out + self.b(h) if use_b else out


def make_two_heads():
    torch.manual_seed(11)
    return TwoHeads()


@check
def unused_parameters():
    model, ref = make_two_heads(), make_two_heads()
    opt = hvd.DistributedOptimizer(sgd(model), named_parameters=model.named_parameters())
    ref_opt = sgd(ref)
    never_before = model.never.weight.detach().clone()
    for step in range(STEPS):
        x, y = global_batch(step, salt=8)
        opt.zero_grad()
        # Head b only on rank 0; head "never" on no rank.
        F.mse_loss(model(local(x), use_b=RANK == 0), local(y)).backward()
        opt.step()
        # Reference: the average of every rank's loss.
        ref_opt.zero_grad()
        loss = sum(F.mse_loss(ref(x[r * N_LOCAL:(r + 1) * N_LOCAL], use_b=r == 0),
                              y[r * N_LOCAL:(r + 1) * N_LOCAL]) for r in range(SIZE)) / SIZE
        loss.backward()
        ref_opt.step()
    assert_same_as(model, ref)
    assert_identical_across_ranks(model)
    assert torch.equal(model.never.weight.detach(), never_before)


@check
def load_state_dict_clears():
    model, ref = make_model(), make_model()
    opt = hvd.DistributedOptimizer(sgd(model), named_parameters=model.named_parameters())
    ref_opt = sgd(ref)
    for step in range(2):
        x, y = global_batch(step, salt=9)
        step_both(model, opt, ref, ref_opt, x, y)
    saved = opt.state_dict()
    x, y = global_batch(50, salt=9)
    opt.zero_grad()
    F.mse_loss(model(local(x)), local(y)).backward()
    assert opt._handles
    # Let the submitted allreduces finish before they are dropped. (On the flat path nothing
    # is submitted before synchronize(): every handle is the placeholder of a deferred one.)
    handles = [h for h, _ in opt._handles.values() if h is not hopt._DEFERRED]
    assert FLAT or len(handles) == 4
    while not all(hvd.poll(h) for h in handles):
        pass
    for h in handles:
        hvd.synchronize(h)
    opt.load_state_dict(saved)
    assert opt._handles == {}
    assert all(v == 1 for v in opt._allreduce_delay.values())
    opt.zero_grad()  # no outstanding handles any more
    for p in model.parameters():
        torch.testing.assert_close(opt.state[p]["momentum_buffer"],
                                   ref_opt.state[ref.get_parameter(
                                       dict((id(q), n) for n, q in model.named_parameters())[
                                           id(p)])]["momentum_buffer"])
    for step in range(2, 4):
        x, y = global_batch(step, salt=9)
        step_both(model, opt, ref, ref_opt, x, y)
    assert_same_as(model, ref)


@check
def validation_errors():
    model = make_model()
    named = list(model.named_parameters())
    cases = [
        (dict(named_parameters=[("w", named[0][1]), ("w", named[1][1]), ("x", named[2][1]),
                                ("y", named[3][1])]),
         ValueError, "Parameter names in named_parameters must be unique. Found duplicates: w"),
        (dict(named_parameters=named[:3]), ValueError,
         "named_parameters was specified, but one or more model parameters were not named. "
         "Python object ids: "),
        (dict(named_parameters=[p for _, p in named]), ValueError,
         "named_parameters should be a sequence of tuples (name, parameter), usually produced "
         "by model.named_parameters()."),
        # op=Adasum itself works now (tests/test_adasum.py); Horovod's predivide rule still holds.
        (dict(op=hvd.Adasum, gradient_predivide_factor=2.0), ValueError,
         "gradient_predivide_factor not supported with op != Average"),
    ]
    for kwargs, exc_type, msg in cases:
        try:
            hvd.DistributedOptimizer(sgd(model), **kwargs)
        except exc_type as exc:
            assert str(exc).startswith(msg), (str(exc), msg)
        else:
            raise AssertionError(f"{kwargs} did not raise")


@check
def closure_and_wrapped_optimizer_untouched():
    # step(closure) returns the closure's loss; the wrapped optimizer object is not modified.
    model = make_model()
    base = sgd(model)
    opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
    assert type(base) is torch.optim.SGD
    x, y = global_batch(0)
    opt.zero_grad()
    F.mse_loss(model(local(x)), local(y)).backward()
    loss = opt.step(closure=lambda: torch.tensor(3.0))
    assert float(loss) == 3.0
    assert_identical_across_ranks(model)


@check
def recreated_optimizer():
    # Wrapping the same model again (say, with a new learning rate): the dropped optimizer's
    # hooks must not fire any more.
    import gc
    model, ref = make_model(), make_model()
    opt = hvd.DistributedOptimizer(sgd(model, lr=0.5), named_parameters=model.named_parameters())
    x, y = global_batch(0, salt=12)
    F.mse_loss(model(local(x)), local(y)).backward()
    opt.synchronize()
    del opt
    gc.collect()
    model.zero_grad()
    CALLS.clear()
    opt = hvd.DistributedOptimizer(sgd(model), named_parameters=model.named_parameters())
    ref_opt = sgd(ref)
    for step in range(STEPS):
        x, y = global_batch(step, salt=12)
        step_both(model, opt, ref, ref_opt, x, y)
    assert len(per_param(CALLS)) == (1 if FLAT else STEPS) * 4, len(CALLS)
    assert_flat(opt, model, STEPS - 1)
    assert_same_as(model, ref)
    assert_identical_across_ranks(model)


@check
def flat_gradients():
    # Gradients zeroed in place (set_to_none=False) stay the flat buffer's views: backward
    # accumulates into them and nothing is copied; set to None, a fresh gradient is copied in
    # from its hook. Both match the reference.
    for set_to_none in (False, True):
        model, ref = make_model(), make_model()
        opt = hvd.DistributedOptimizer(sgd(model), named_parameters=model.named_parameters())
        ref_opt = sgd(ref)
        views = None
        for step in range(STEPS):
            x, y = global_batch(step, salt=13)
            opt.zero_grad(set_to_none=set_to_none)
            F.mse_loss(model(local(x)), local(y)).backward()
            opt.step()
            if FLAT and step >= 1:
                grads = [p.grad for p in model.parameters()]
                if views is not None and not set_to_none:
                    assert all(g is v for g, v in zip(grads, views))
                views = grads
            ref_opt.zero_grad()
            F.mse_loss(ref(x), y).backward()
            ref_opt.step()
        assert_same_as(model, ref)
        assert_identical_across_ranks(model)
        assert bool(opt._flat and opt._flat.active) == FLAT

    # The ranks agree or nobody takes the flat path: rank 1 turns it off (the variable is read
    # when the ranks agree), and then a layout that differs between the ranks.
    def off_on_rank_1():
        os.environ["HVDLITE_FLAT_GRADIENTS"] = "0" if RANK == 1 else "1"

    def other_layout_on_rank_1():
        os.environ.pop("HVDLITE_FLAT_GRADIENTS", None)
        if RANK == 1:
            hflat._digest = lambda members, names: b"\x01" * 8

    real_digest, saved_env = hflat._digest, os.environ.get("HVDLITE_FLAT_GRADIENTS")
    try:
        for disagree in (off_on_rank_1, other_layout_on_rank_1):
            disagree()
            CALLS.clear()
            model, ref, opt = train_pair(sgd, sgd, salt=14)
            assert not opt._flat.active and not flat_calls(CALLS), disagree.__name__
            assert len(per_param(CALLS)) == STEPS * 4, (disagree.__name__, len(CALLS))
            assert_same_as(model, ref)
            assert_identical_across_ranks(model)
    finally:
        hflat._digest = real_digest
        if saved_env is None:
            os.environ.pop("HVDLITE_FLAT_GRADIENTS", None)
        else:
            os.environ["HVDLITE_FLAT_GRADIENTS"] = saved_env

    # A parameter whose dtype changes after the ranks agreed sends the step back to the
    # per-parameter path, and the ranks agree again on the new layout at its end.
    CALLS.clear()
    model, ref = make_model(), make_model()
    opt = hvd.DistributedOptimizer(sgd(model), named_parameters=model.named_parameters())
    ref_opt = sgd(ref)
    for step in range(STEPS + 1):
        if step == 2:
            model.double()
            ref.double()
        x, y = global_batch(step, salt=15)
        if step >= 2:
            x, y = x.double(), y.double()
        step_both(model, opt, ref, ref_opt, x, y)
    flats = [c["name"].split(".")[3] for c in flat_calls(CALLS)]
    assert flats == (["float32", "float64", "float64"] if FLAT else []), flats
    assert len(per_param(CALLS)) == (8 if FLAT else 20), len(CALLS)
    assert_same_as(model, ref)
    assert_identical_across_ranks(model)


@check
def join_before_first_step():
    # Rank 1 joins (no data) before its first step while rank 0 takes two, then both train
    # together: the ranks must agree on the flat path at that first common step (rank 0's
    # agreements during the join saw rank 1's zeros, not its vote), not hang on an agreement
    # only rank 1 submits.
    model = make_model()
    opt = hvd.DistributedOptimizer(sgd(model, momentum=0.0),
                                   named_parameters=model.named_parameters())
    if RANK == 0:
        for step in range(2):
            x, y = global_batch(step, salt=16)
            opt.zero_grad()
            F.mse_loss(model(local(x)), local(y)).backward()
            opt.step()
    hvd.join()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    ref = make_model()
    ref.load_state_dict(model.state_dict())
    ref_opt = sgd(ref, momentum=0.0)
    for step in range(2, 2 + STEPS):
        x, y = global_batch(step, salt=16)
        step_both(model, opt, ref, ref_opt, x, y)
    assert_same_as(model, ref)
    assert_identical_across_ranks(model)
    assert bool(opt._flat.active) == FLAT


@check
def torch_compile():
    # A model compiled with torch.compile trains as the plain one does: the optimizer's hooks
    # sit on the parameters, which the compiled graph's backward accumulates into, on every
    # gradient path. A compiled function that calls hvdlite's collectives runs them at a
    # graph break, eagerly. "aot_eager" traces through Dynamo and AOTAutograd (the parts that
    # meet autograd's hooks) without inductor's C++ compiler.
    import torch._dynamo
    torch._dynamo.reset()
    model, ref = make_model(seed=21), make_model(seed=21)
    compiled = torch.compile(model, backend="aot_eager")
    opt = hvd.DistributedOptimizer(sgd(model), named_parameters=model.named_parameters())
    ref_opt = sgd(ref)
    for step in range(STEPS):
        x, y = global_batch(step, salt=21)
        step_both(compiled, opt, ref, ref_opt, x, y)
    assert_same_as(model, ref)
    assert_identical_across_ranks(model)
    assert bool(opt._flat.active) == FLAT

    @torch.compile(backend="aot_eager")
    def reduce_then_shift(t):
        return hvd.allreduce(t * 2, op=hvd.Sum, name="compiled.sum") + 1

    got = reduce_then_shift(torch.full((5,), float(RANK + 1)))
    want = torch.full((5,), float(sum(2 * (r + 1) for r in range(SIZE)) + 1))
    torch.testing.assert_close(got, want)
    torch._dynamo.reset()


for fn in CHECKS:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        harness.check(fn.__name__, fn)
    if harness.FAILURES:   # later checks assume this one's state: stop every rank at once
        break
harness.finish()
if harness.FAILURES:
    sys.exit(1)
hvd.shutdown()
