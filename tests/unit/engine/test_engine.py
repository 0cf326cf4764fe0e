"""The engine on the synchronous CPU device, with a plain torch AdamW as the state owner.

Bodies that read state after a reload run in the isolated process (a bug there would
touch released memory, which crashes torch on CPU).
"""

import pytest
import torch

from megatron_offload.device import CPUDevice
from megatron_offload.engine import OffloadEngine, OffloadStateError, Place

STATES, MASTERS = "optimizer_states", "master_weights"


def aligned(tensor_or_numel, itemsize=4):
    """Bytes a tensor takes in a consolidated group: each starts on a 16-byte boundary."""
    numel = tensor_or_numel if isinstance(tensor_or_numel, int) else tensor_or_numel.numel()
    return -(-numel * itemsize // 16) * 16


class Model:
    """Parameters + AdamW, with a collect() in the shape the adapters produce."""

    def __init__(self, sizes=(5, 7, 3, 11), dtype=torch.float32, seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.params = [torch.nn.Parameter(torch.randn(n, generator=gen).to(dtype)) for n in sizes]
        self.opt = torch.optim.AdamW(self.params, lr=0.01)
        self.gen = torch.Generator().manual_seed(seed + 1)

    def collect(self):
        for p in self.params:
            yield MASTERS, p
        for p in self.params:
            state = self.opt.state.get(p, {})
            for key in sorted(state):
                if key != "step":
                    yield STATES, state[key]

    def step(self):
        for p in self.params:
            p.grad = torch.randn(p.shape, generator=self.gen).to(p.dtype)
        self.opt.step()

    def snapshot(self):
        out = [p.detach().clone() for p in self.params]
        for p in self.params:
            for key, value in sorted(self.opt.state.get(p, {}).items()):
                out.append(value.clone())
        return out


def tracked_storage_bytes(model):
    return [t.untyped_storage().nbytes() for _, t in model.collect()]


def _cycles_bitwise(sizes, dtype, steps, skip_every):
    """Offload on vs off over ``steps`` steps; every ``skip_every``-th step is skipped."""
    ref, off = Model(sizes, dtype), Model(sizes, dtype)
    engine = OffloadEngine(CPUDevice(), off.collect)
    figures = []
    for i in range(steps):
        skipped = skip_every and i % skip_every == skip_every - 1
        if engine.is_released():
            engine.reload()
            engine.wait()
        if not skipped:
            ref.step()
            engine.mark_dirty()
            off.step()
        else:  # nothing reads the gradients: keep the generators aligned
            ref.gen.manual_seed(ref.gen.initial_seed() + i)
            off.gen.manual_seed(off.gen.initial_seed() + i)
        engine.offload(skip_unchanged=True)
        engine.release()
        stats = engine.stats()
        figures.append(
            (
                skipped,
                stats["d2h_copies"],
                stats["offloaded_bytes"],
                stats["tracked_bytes"],
                stats["host_bytes"],
                max(tracked_storage_bytes(off)),
            )
        )
    engine.reload()
    engine.wait()
    same = all(torch.equal(a, b) for a, b in zip(ref.snapshot(), off.snapshot()))
    return same, len(ref.snapshot()), figures, engine.stats()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_offloading_is_bitwise_invisible_to_the_optimizer(isolated, dtype):
    same, count, figures, stats = isolated.run(_cycles_bitwise, (5, 7, 3, 11), dtype, 12, 4)
    assert same and count == 4 * 4  # params, exp_avg, exp_avg_sq, step
    for skipped, d2h, offloaded, tracked, host, max_bytes in figures:
        assert offloaded == tracked > 0  # everything went
        assert max_bytes == 0  # ... and holds no memory between steps
        assert host == tracked  # exactly sized host memory
        if skipped:
            assert d2h == 0  # rule 6: the host copy is still valid
    # steady state: one copy per group (2 kinds, 1 dtype) per direction
    assert [f[1] for f in figures[2:] if not f[0]] == [2] * sum(1 for f in figures[2:] if not f[0])
    assert stats["h2d_copies"] == 2


def _copies_per_cycle(n_params):
    model = Model(sizes=[3 + i % 5 for i in range(n_params)])
    engine = OffloadEngine(CPUDevice(), model.collect)
    for _ in range(3):
        if engine.is_released():
            engine.reload()
            engine.wait()
        engine.mark_dirty()
        model.step()
        engine.offload()
        engine.release()
    engine.reload()
    engine.wait()
    return engine.stats()["d2h_copies"], engine.stats()["h2d_copies"], engine.stats()["tensors"]


def test_copies_per_cycle_do_not_grow_with_parameter_count(isolated):
    small = isolated.run(_copies_per_cycle, 10)
    large = isolated.run(_copies_per_cycle, 100)
    assert small[2] == 30 and large[2] == 300
    assert small[:2] == large[:2] == (2, 2)


def _masters_before_first_step():
    ref, off = Model(), Model()
    engine = OffloadEngine(CPUDevice(), off.collect)
    engine.offload()  # no moments exist yet: only the masters move
    engine.release()
    stats = engine.stats()
    only_masters = stats["offloaded_bytes"] == sum(aligned(p) for p in off.params)
    # The payload leaves out the alignment padding the layout adds.
    only_masters &= stats["offloaded_payload_bytes"] == sum(
        p.numel() * p.element_size() for p in off.params
    )
    only_masters &= stats["offloaded_payload_bytes"] < stats["offloaded_bytes"]
    released = all(p.untyped_storage().nbytes() == 0 for p in off.params)
    engine.reload()
    engine.wait()
    intact = all(torch.equal(a, b) for a, b in zip(ref.params, off.params))
    for m in (ref, off):
        m.step()
    engine.mark_dirty()
    engine.offload()  # moments appeared: the layout is rebuilt
    engine.release()
    engine.reload()
    engine.wait()
    same = all(torch.equal(a, b) for a, b in zip(ref.snapshot(), off.snapshot()))
    return only_masters, released, intact, same, len(engine.pieces)


def test_masters_offloaded_before_the_first_step_come_back_intact(isolated):
    assert isolated.run(_masters_before_first_step) == (True, True, True, True, 2)


def _views_survive():
    model = Model()
    model.step()
    engine = OffloadEngine(CPUDevice(), model.collect)
    for _ in range(2):  # the second cycle runs consolidated
        engine.offload()
        engine.release()
        engine.reload()
        engine.wait()
    exp_avg = model.opt.state[model.params[1]]["exp_avg"]
    view = exp_avg.view(-1)[2:5]
    expected = view.clone()
    engine.offload()
    engine.release()
    released = view.untyped_storage().nbytes() == 0
    engine.reload()
    engine.wait()
    return (
        released,
        torch.equal(view, expected),
        model.opt.state[model.params[1]]["exp_avg"] is exp_avg,
    )


def test_tensor_objects_and_views_survive_a_cycle(isolated):
    assert isolated.run(_views_survive) == (True, True, True)


def _shared_storage_is_not_freed_under_its_other_owner():
    base = torch.arange(20, dtype=torch.float32)
    tracked = base[4:10]  # a view: the rest of ``base`` belongs to someone else
    engine = OffloadEngine(CPUDevice(), lambda: [(STATES, tracked)])
    engine.offload()
    engine.release()
    base_intact = torch.equal(base, torch.arange(20, dtype=torch.float32))
    unreleasable = engine.stats()["unreleasable_bytes"]
    engine.reload()
    engine.wait()
    return base_intact, unreleasable, torch.equal(tracked, torch.arange(4, 10, dtype=torch.float32))


def test_a_view_into_a_shared_storage_leaves_the_other_owner_intact(isolated):
    assert isolated.run(_shared_storage_is_not_freed_under_its_other_owner) == (True, 80, True)


def test_aliasing_tensors_are_refused():
    base = torch.zeros(10)
    engine = OffloadEngine(CPUDevice(), lambda: [(STATES, base[:6]), (STATES, base[4:])])
    with pytest.raises(ValueError, match="share memory"):
        engine.offload()


def test_release_before_offload_is_refused():
    model = Model()
    engine = OffloadEngine(CPUDevice(), model.collect)
    engine.offload([STATES])  # no states yet: builds the groups, moves nothing
    with pytest.raises(OffloadStateError, match="offload\\(\\) first"):
        engine.release([MASTERS])


def test_close_while_released_is_refused():
    model = Model()
    engine = OffloadEngine(CPUDevice(), model.collect)
    engine.offload()
    engine.release()
    with pytest.raises(OffloadStateError, match="reload\\(\\) first"):
        engine.close()
    engine.reload()
    engine.close()
    engine.close()  # twice is harmless
    assert engine.stats()["host_bytes"] == 0
    for move in (engine.offload, engine.release, engine.reload, engine.rescan):
        with pytest.raises(OffloadStateError, match="closed"):
            move()


def test_a_fingerprint_unchanged_lays_nothing_out_again():
    model = Model()
    looks = []

    def collect():
        looks.append(1)
        return model.collect()

    engine = OffloadEngine(CPUDevice(), collect, fingerprint=lambda: "same")
    engine.offload()
    engine.reload()
    engine.rescan()  # the fingerprint says nothing changed: collect is not asked
    engine.offload()
    assert len(looks) == 1 and not engine.adopted
    engine.invalidate()  # something it cannot see changed: asked again
    engine.rescan()
    assert len(looks) == 2
    engine.close()


def test_tensors_the_engine_cannot_move_stay_resident_and_are_counted():
    strided = torch.zeros(4, 4).t()  # not contiguous
    engine = OffloadEngine(CPUDevice(), lambda: [(STATES, strided)])
    engine.offload()
    engine.release()
    stats = engine.stats()
    assert stats["kept_resident_bytes"] == 64 and stats["tracked_bytes"] == 0
    assert strided.untyped_storage().nbytes() == 64


def test_kinds_move_independently():
    model = Model()
    model.step()
    engine = OffloadEngine(CPUDevice(), model.collect)
    engine.offload([STATES])
    engine.release([STATES])
    assert all(p.untyped_storage().nbytes() > 0 for p in model.params)
    assert engine.is_released([STATES]) and not engine.is_released([MASTERS])
    engine.reload([STATES])
    engine.wait()
    assert [g.place for g in engine.pieces] == [Place.RESIDENT, Place.RESIDENT]


def test_host_budget_is_checked_before_anything_is_allocated():
    from megatron_offload.engine import HostBudget, HostMemoryBudgetError

    model = Model()
    model.step()
    need = sum(aligned(t) for _, t in model.collect())  # one fp32 group per kind
    engine = OffloadEngine(
        CPUDevice(), model.collect, budget=HostBudget(need - 1), name="optimizer 0"
    )
    with pytest.raises(
        HostMemoryBudgetError, match=f"needs {need:,} bytes.*host_memory_budget={need - 1:,}"
    ):
        engine.offload()
    assert engine.stats()["host_bytes"] == 0
    assert all(t.untyped_storage().nbytes() > 0 for _, t in model.collect())
    fits = OffloadEngine(CPUDevice(), model.collect, budget=HostBudget(need))
    fits.offload()
    assert fits.stats()["host_bytes"] == need


def test_the_budget_is_shared_by_the_engines_of_one_offloader():
    from megatron_offload.engine import HostBudget, HostMemoryBudgetError

    first, second = Model(seed=1), Model(seed=2)
    need = sum(aligned(t) for _, t in first.collect())
    budget = HostBudget(need + need // 2)
    holder = OffloadEngine(CPUDevice(), first.collect, budget=budget)
    holder.offload()
    other = OffloadEngine(CPUDevice(), second.collect, budget=budget)
    with pytest.raises(HostMemoryBudgetError, match="already held by the other optimizers"):
        other.offload()
    holder.close()  # gives its host memory (and its share of the budget) back
    other.offload()
    assert other.stats()["host_bytes"] == need


def _partial(fraction):
    ref, off = Model(sizes=(40, 30, 20, 10)), Model(sizes=(40, 30, 20, 10))
    engine = OffloadEngine(CPUDevice(), off.collect, fraction=fraction)
    moved = []
    for _ in range(4):
        if engine.is_released():
            engine.reload()
            engine.wait()
        engine.mark_dirty()
        ref.step()
        off.step()
        engine.offload()
        engine.release()
        stats = engine.stats()
        moved.append((stats["offloaded_bytes"], stats["kept_resident_bytes"]))
    engine.reload()
    engine.wait()
    return all(torch.equal(a, b) for a, b in zip(ref.snapshot(), off.snapshot())), moved


@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_partial_offload_moves_the_largest_tensors_up_to_the_fraction(isolated, fraction):
    same, moved = isolated.run(_partial, fraction)
    assert same
    sizes = (40, 30, 20, 10)  # masters + two moments of each, fp32: 1200 bytes
    # Largest first, whole tensors, up to half of the 1200 bytes: the three 40-element
    # tensors (480) and one 30-element tensor (600). In the device group each tensor starts
    # 16-byte aligned, so 30 elements take 128 bytes there.
    chosen = {0.0: [], 0.5: [40, 40, 40, 30], 1.0: [n for n in sizes for _ in range(3)]}[fraction]
    kept = 1200 - 4 * sum(chosen)
    assert moved[-1] == (sum(aligned(n) for n in chosen), kept)


def test_offload_fraction_out_of_range_is_refused():
    with pytest.raises(ValueError, match="between 0 and 1"):
        OffloadEngine(CPUDevice(), lambda: [], fraction=1.5)


def test_memory_made_non_resizable_is_refused_with_a_clear_error():
    model = Model()
    model.step()
    engine = OffloadEngine(CPUDevice(), model.collect)
    engine.offload()
    engine.release()
    engine.reload()  # consolidated now
    engine.wait()
    model.opt.state[model.params[0]]["exp_avg"].numpy()  # pins the group's storage on CPU
    engine.offload()
    with pytest.raises(OffloadStateError, match="non-resizable.*clone\\(\\).numpy\\(\\)"):
        engine.release()


def test_tensor_subclasses_and_other_devices_stay_resident_with_a_reason():
    class Wrapped(torch.Tensor):
        pass

    wrapped = torch.zeros(4).as_subclass(Wrapped)
    elsewhere = torch.zeros(4, device="meta")
    engine = OffloadEngine(CPUDevice(), lambda: [(STATES, wrapped), (STATES, elsewhere)])
    engine.offload()
    reasons = sorted(reason for _, _, reason in engine.kept_resident)
    assert reasons == ["on meta, not on cpu", "tensor subclass Wrapped"]
    assert engine.stats()["tracked_bytes"] == 0 and "empty" in repr(engine)


def _rebuild_keeps_released_groups():
    masters = [torch.randn(6), torch.randn(10)]
    expected = [m.clone() for m in masters]
    moments = []
    engine = OffloadEngine(
        CPUDevice(), lambda: [(MASTERS, m) for m in masters] + [(STATES, m) for m in moments]
    )
    engine.offload([MASTERS])
    engine.release([MASTERS])
    moments.append(torch.ones(6))  # a new state appears while the masters are on the host
    engine.offload([STATES])  # the layout is rebuilt: the masters' bytes move to the new arena
    still_released = engine.is_released([MASTERS]) and all(
        m.untyped_storage().nbytes() == 0 for m in masters
    )
    engine.release([STATES])
    engine.reload()
    engine.wait()
    intact = all(torch.equal(a, b) for a, b in zip(masters, expected))
    return still_released, intact, torch.equal(moments[0], torch.ones(6)), len(engine.pieces)


def test_a_rebuild_keeps_released_groups_on_the_host(isolated):
    assert isolated.run(_rebuild_keeps_released_groups) == (True, True, True, 2)
