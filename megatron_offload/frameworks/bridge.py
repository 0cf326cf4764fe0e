"""Megatron-Bridge: offloading as one training callback.

Bridge trains with a loop of its own (``megatron/bridge/training/train.py``), which the
``--offload-optimizer-states`` patches of ``megatron.training`` never reach. It calls
callbacks at fixed points instead, so offloading is one more callback::

    from megatron.bridge.training.pretrain import pretrain
    from megatron_offload.frameworks.bridge import OptimizerStateOffloadCallback

    pretrain(cfg, forward_step, callbacks=[OptimizerStateOffloadCallback()])

The options are ``attach``'s (the fields of ``OffloadConfig``), checked when the callback is
made. At Bridge's events:

* ``on_train_start`` (the optimizer is built and the checkpoint loaded): ``attach`` to the
  optimizer, which refuses ``optimizer_cpu_offload``, optimizer CUDA graphs and
  megatron-core's own offloader before anything is touched; the reload then starts from
  the model's ``finalize_model_grads_func`` (during the gradient reduction, ``prefetch``'s
  default) and every step offloads after itself.
* ``on_checkpoint_save``: Bridge's saves go through megatron-core's ``sharded_state_dict``,
  served from the host copy; states a save had to bring back (Transformer Engine's FP8
  moments) are offloaded again at once instead of at the next step, unless an asynchronous
  writer other than megatron-core's own (``async_strategy="mcore"``) may still read them.
* ``on_train_step_end``: every ``cfg.logger.log_interval`` iterations, the figures (max over
  ranks; collective, as Bridge's own logging) are printed and written to Bridge's
  TensorBoard and W&B writers.
* ``on_train_end``: the offloader is detached (its gradient-reduction hook taken back, the
  states back on the device, as Bridge found them).

Nothing here imports Bridge: its ``CallbackManager.add`` registers any object's ``on_*``
methods.
"""

from __future__ import annotations

from ..config import OffloadConfig
from ..megatron.training import save_is_staged_on_return
from ..offloader.cycle import attach
from ..report import log_offload_stats


class OptimizerStateOffloadCallback:
    """Offloads the optimizer's states between steps of Bridge's ``train()``.

    Args:
        config: an ``OffloadConfig`` (None: the defaults, or ``options``).
        log: print and write the figures at Bridge's log interval.
        **options: fields of ``OffloadConfig`` (as ``attach`` takes them).
    """

    def __init__(self, config: OffloadConfig | None = None, *, log: bool = True, **options) -> None:
        # Checked now, when the user builds the callback list, not at train start.
        self.config = OffloadConfig.from_options(config, **options)
        self.log = log
        self.offloader = None
        # Bridge's GlobalState, kept from train start: later events may come with a context
        # that carries less (an open Bridge change gives checkpoint events no optimizer).
        self._state = None

    # ------------------------------------------------------------------ events
    def on_train_start(self, context) -> None:
        if self.offloader is not None:
            raise RuntimeError(
                "OptimizerStateOffloadCallback: train started twice with one callback; give each "
                "pretrain() call a callback of its own."
            )
        self.offloader = attach(context.optimizer, self.config)
        self._state = getattr(context, "state", None)

    def on_checkpoint_save(self, context) -> None:
        offloader = self.offloader
        if offloader is None or offloader.detached or not _resident_bytes(offloader):
            return
        checkpoint = getattr(getattr(self._state_of(context), "cfg", None), "checkpoint", None)
        if checkpoint is not None and not save_is_staged_on_return(checkpoint):
            # An asynchronous writer other than megatron-core's own may still read the device
            # tensors: they stay until the next step's offload.
            return
        offloader.offload()

    def on_train_step_end(self, context) -> None:
        if not self.log or self.offloader is None or self.offloader.detached:
            return
        state = self._state_of(context)
        if state is None:
            return
        interval = getattr(getattr(state.cfg, "logger", None), "log_interval", None)
        step = state.train_state.step
        if interval and step % interval == 0:
            log_offload_stats(
                step,
                self.offloader,
                writer=_writer(state, "tensorboard_logger"),
                wandb_writer=_writer(state, "wandb_logger"),
            )

    def _state_of(self, context):
        """The event's GlobalState, else the one train start had (the callback needs nothing
        else from an event's context: the optimizer is the offloader's own)."""
        return getattr(context, "state", None) or self._state

    def on_train_end(self, context) -> None:
        if self.offloader is not None:
            self.offloader.detach()


def _resident_bytes(offloader) -> int:
    stats = offloader.stats()
    return stats["tracked_bytes"] - stats["offloaded_bytes"]


def _writer(state, name: str):
    """Bridge's writer (made lazily, on the last rank, where the logger config asks for it)."""
    return getattr(state, name, None)
