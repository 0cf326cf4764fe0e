"""The FusedAdam double's states (Transformer Engine): made, scaled, read, written, saved, loaded.

Split from ``te_fused_adam.py``: behaviours 2 to 6 of the list there (state layout, creation,
dtypes and scales, unscaled reads and scaled writes, state dicts) and the rescaling of
behaviour 7 (``_apply_scale``). ``FusedAdamStates`` holds these methods of TE's ``FusedAdam``
(the same names and signatures; megatron-core and the offloader call them); ``FusedAdam``
inherits them, and its constructor sets the attributes they read (``name_to_dtype_map``,
``dtype_to_range_map``, ``_scales``, ``master_weights``, ``store_param_remainders``,
``te_line``).
"""

from __future__ import annotations

from copy import deepcopy
from itertools import chain

import torch

from .te_float8 import DType, Float8Quantizer, Float8Tensor

_UNSET = object()


class FusedAdamStates(torch.optim.Optimizer):
    """The state methods of TE's ``FusedAdam``; ``FusedAdam``'s constructor sets what they read."""

    # --------------------------------------------------------------------- scaling
    def _apply_scale(self, state_name, unscaled_state, scaled_state, scale):
        """Write fp32 ``unscaled_state`` into low-precision ``scaled_state``; ``scale`` in place."""
        assert unscaled_state.dtype == torch.float32
        if scaled_state.dtype == torch.bfloat16:
            scaled_state.copy_(unscaled_state.bfloat16())
            return
        dtype = self.name_to_dtype_map[state_name]
        if dtype == torch.uint8:
            assert isinstance(scaled_state, Float8Tensor)
            assert len(scaled_state._quantizer.scale) == 1, (
                "Only scaling with one scaling factor per tensor is supported by the FusedAdam."
            )
        else:
            assert scaled_state.dtype == dtype
        max_range = self.dtype_to_range_map[dtype]
        if max_range.device != scaled_state.device:
            max_range = max_range.to(scaled_state.device)
            self.dtype_to_range_map[scaled_state.dtype] = max_range
        if unscaled_state.device != scaled_state.device:
            unscaled_state = unscaled_state.to(scaled_state.device)
        min_val, max_val = torch.aminmax(unscaled_state)
        absmax = torch.maximum(-min_val, max_val)
        absmax = absmax.to(dtype=torch.float32, device=unscaled_state.device)
        torch.div(absmax, max_range, out=scale)
        if isinstance(scaled_state, Float8Tensor):
            scaled_state._quantizer.scale.copy_(1 / scale)
            scaled_state.copy_(unscaled_state)
        else:
            rscale = torch.where(scale > 0, scale.reciprocal(), 0.0)
            unscaled_state.mul_(rscale)
            scaled_state.copy_(unscaled_state)

    def get_unscaled_state(self, param, state_name, skip_unscale=_UNSET):
        """The fp32 value of a state: LIVE for fp32/int16 states, a new tensor otherwise
        (TE >= 2.13: with ``skip_unscale=True`` a bf16 state is returned LIVE, in bf16)."""
        if skip_unscale is _UNSET:
            skip_unscale = False
        elif self.te_line == "2.12":
            raise TypeError(
                "get_unscaled_state() got an unexpected keyword argument 'skip_unscale'"
            )
        state = self.state[param]
        dtype = self.name_to_dtype_map[state_name]
        if dtype == torch.uint8:
            unscaled = state[state_name].float()
        elif dtype == torch.float16:
            assert state[state_name].dtype == torch.float16
            unscaled = state[state_name].float()
            unscaled.mul_(self._scales[param][state_name])
        elif dtype == torch.float32:
            if (
                self.store_param_remainders
                and state_name == "master_param"
                and param.dtype == torch.bfloat16
            ):
                assert state[state_name].dtype == torch.int16
            else:
                assert state[state_name].dtype == torch.float32
            unscaled = state[state_name]
        elif dtype == torch.bfloat16:
            assert state[state_name].dtype == torch.bfloat16
            unscaled = state[state_name] if skip_unscale else state[state_name].float()
        else:
            raise RuntimeError(f"Dtype of {state_name} can only be fp8/fp16/bf16/fp32.")
        return unscaled

    def set_scaled_state(self, param, state_name, unscaled_state):
        """Write an fp32 (int16 for remainders) value into a state, scaling as needed."""
        store_param_remainders = (
            self.store_param_remainders
            and state_name == "master_param"
            and param.dtype == torch.bfloat16
        )
        if store_param_remainders:
            assert unscaled_state.dtype == torch.int16
        else:
            assert unscaled_state.dtype == torch.float32
        state = self.state[param]
        if state_name not in state:
            self._initialize_state(param, state_name, False, store_param_remainders)
        dtype = self.name_to_dtype_map[state_name]
        if dtype != torch.float32:
            scale = self._scales[param]
            self._apply_scale(state_name, unscaled_state, state[state_name], scale[state_name])
        else:
            state[state_name].copy_(unscaled_state)

    # ------------------------------------------------------------------ state creation
    def _initialize_state(
        self, param, state_name, zero_buffer: bool, store_param_remainders: bool = False
    ):
        dtype = self.name_to_dtype_map[state_name]
        if isinstance(param, Float8Tensor):
            raise NotImplementedError("the FusedAdam double does not reproduce FP8 parameters")
        if store_param_remainders:
            data = torch.zeros_like(param, dtype=torch.int16)
        else:
            data = torch.empty_like(param, dtype=dtype)
        if zero_buffer:
            data.zero_()
        if dtype == torch.uint8:
            quantizer = Float8Quantizer(
                scale=torch.ones([1], dtype=torch.float32, device=param.device),
                amax=torch.zeros([1], dtype=torch.float32, device=param.device),
                fp8_dtype=DType.kFloat8E4M3,
            )
            self.state[param][state_name] = quantizer.make_empty(param.shape)
            self.state[param][state_name].quantize_(data.float())
        else:
            self.state[param][state_name] = data
        if dtype != torch.float32:
            if param not in self._scales:
                self._scales[param] = {}
            self._scales[param][state_name] = torch.ones(
                [1], dtype=torch.float32, device=param.device
            )

    def initialize_state(self, param, store_param_remainders):
        """Create ``exp_avg``, ``exp_avg_sq`` and (with master weights) ``master_param``."""
        self._initialize_state(param, "exp_avg", zero_buffer=True)
        self._initialize_state(param, "exp_avg_sq", zero_buffer=True)
        if self.master_weights:
            self._initialize_state(
                param,
                "master_param",
                zero_buffer=False,
                store_param_remainders=store_param_remainders,
            )
            if not store_param_remainders:
                self.set_scaled_state(param, "master_param", param.clone().detach().float())

    # ------------------------------------------------------------------ state dicts
    def _saved_ids_to_params(self, state_dict) -> dict:
        """The saved parameter ids of ``state_dict``, mapped to this optimizer's parameters."""
        saved_groups = deepcopy(state_dict["param_groups"])
        return dict(
            zip(
                chain.from_iterable(g["params"] for g in saved_groups),
                chain.from_iterable(g["params"] for g in self.param_groups),
            )
        )

    def state_dict(self):
        """torch's state dict with every state replaced by its unscaled (fp32/int16) value."""
        state_dict = super().state_dict()
        id_map = self._saved_ids_to_params(state_dict)
        for k, v in state_dict["state"].items():
            if k in id_map:
                param = id_map[k]
                state_dict["state"][k] = {name: self.get_unscaled_state(param, name) for name in v}
        return state_dict

    def load_state_dict(self, state_dict):
        """torch's load, then every state rebuilt (new tensors) through ``set_scaled_state``."""
        super().load_state_dict(state_dict)
        id_map = self._saved_ids_to_params(state_dict)
        for k, v in state_dict["state"].items():
            if k in id_map:
                param = id_map[k]
                self.state[param] = {}
                for name in v:
                    if v[name] is None:
                        continue
                    if (
                        self.store_param_remainders
                        and name == "master_param"
                        and param.dtype == torch.bfloat16
                    ):
                        self.set_scaled_state(param, name, v[name])
                        assert v[name].dtype == torch.int16
                    else:
                        self.set_scaled_state(param, name, v[name].float())
