"""Run megatron.training (``pretrain`` and its training loop) on CPU ranks with gloo.

`install()` first installs `cpu_megatron` (the megatron-core redirects), then the few
megatron.training-specific ones below, each found by leaving it out of a 2- or 4-rank
``pretrain`` run with mock data on megatron-core 0.19.2 (and kept working on 0.17.1 and
0.18.2) (it failed, or for the checkpoint
Manager, cost seconds per rank). Nothing here is used by the offloader: it only lets the
example script and the functional tests run the stock training loop on a machine without an
accelerator. Call it only when no GPU exists.

What a CPU run also needs that is not a redirect: the flags ``--distributed-backend gloo
--transformer-impl local --no-gradient-accumulation-fusion --no-persist-layer-norm
--no-masked-softmax-fusion`` and an ``--eval-interval`` (even with ``--eval-iters 0``), no
``--sequence-parallel`` (torch's LayerNorm refuses it), ``CUDA_DEVICE_MAX_CONNECTIONS=1`` with
tensor parallelism (as on pre-Blackwell GPUs), and a pinned ``OMP_NUM_THREADS`` for results
that do not depend on the thread count.
"""

from __future__ import annotations

import functools

import torch

from . import cpu_megatron

_installed = False
# (owner, attribute) -> the value install() replaced.
ORIGINALS: dict = {}


def _patch(owner, name: str, value) -> None:
    ORIGINALS[(owner, name)] = getattr(owner, name)
    setattr(owner, name, value)


def _allow_no_cuda(initialize_megatron):
    """initialize_megatron asserts torch.cuda.is_available() unless allow_no_cuda=True.

    (With the assert passed, the device count of one that cpu_megatron reports makes it run
    the model-parallel and RNG setup it would skip for zero devices.)
    """

    @functools.wraps(initialize_megatron)
    def initialize(*args, **kwargs):
        kwargs["allow_no_cuda"] = True
        return initialize_megatron(*args, **kwargs)

    return initialize


def install() -> None:
    """Install the megatron-core and megatron.training CPU redirects (idempotent)."""
    global _installed
    if _installed:
        return
    cpu_megatron.install()

    import megatron.training
    import megatron.training.initialize as initialize
    import megatron.training.training as training

    # Needed: pretrain() calls initialize_megatron() without allow_no_cuda, which asserts CUDA.
    wrapped = _allow_no_cuda(initialize.initialize_megatron)
    _patch(initialize, "initialize_megatron", wrapped)
    _patch(training, "initialize_megatron", wrapped)
    _patch(megatron.training, "initialize_megatron", wrapped)

    # Needed with tensor (or context) parallelism: validate_args asks for the compute capability
    # (torch.cuda.get_device_properties, which initializes CUDA). Report 0, "no CUDA arch":
    # validation then takes the pre-Blackwell path, which wants CUDA_DEVICE_MAX_CONNECTIONS=1 in
    # the environment exactly as on such GPUs.
    import importlib

    def no_cuda_arch():
        return 0

    # Where each line keeps (or re-exports) it: megatron.training.utils is a module up to 0.17
    # and a package with common_utils from 0.18 on.
    for name in (
        "megatron.training.arguments",
        "megatron.training.utils",
        "megatron.training.utils.common_utils",
    ):
        try:
            owner = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(owner, "get_device_arch_version"):
            _patch(owner, "get_device_arch_version", no_cuda_arch)

    # The first torch_dist checkpoint save creates a multiprocessing Manager for its write
    # results with the 'spawn' context, which re-imports __main__ (the whole training script,
    # several seconds per rank). A forked Manager serves the same queue.
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    original_queue = filesystem_async.get_write_results_queue

    @functools.wraps(original_queue)
    def fork_results_queue(mp_mode: str = "fork"):
        return original_queue("fork")

    _patch(filesystem_async, "get_write_results_queue", fork_results_queue)

    # Needed for a resumed run to train as the run that never stopped: with the CPU generator
    # standing in for the CUDA RNG tracker, building the data iterators draws from the
    # generator the checkpoint load just restored (on a GPU that draw hits the CPU generator,
    # not the CUDA one the dropout masks come from). In a resumed run only (iteration > 0),
    # the generator is set back after the build; a run from scratch is unchanged.
    original_build = training.build_train_valid_test_data_iterators

    @functools.wraps(original_build)
    def build_iterators(*args, **kwargs):
        from megatron.training.global_vars import get_args

        if not getattr(get_args(), "iteration", 0):
            return original_build(*args, **kwargs)
        state = torch.random.get_rng_state()
        try:
            return original_build(*args, **kwargs)
        finally:
            torch.random.set_rng_state(state)

    _patch(training, "build_train_valid_test_data_iterators", build_iterators)
    _installed = True


def is_installed() -> bool:
    return _installed
